// strata-bench links: this machine's ceilings, before trusting any other number: pinned H2D,
// D2H and both at once (cudaMemcpyAsync between Strata's pinned arena and HBM), pageable H2D,
// host memory bandwidth (a multi-threaded STREAM triad), and NVMe read and write (fio).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "bench_options.h"
#include "bench_report.h"
#include "bench_strata.h"
#include "device_peer.h"
#include "fio_peer.h"
#include "host_triad.h"
#include "strata/strata.h"

namespace strata_bench {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

int run_links(const Options& opt, Report* report) {
  const uint64_t size = opt.bytes("size", 1ull << 30);
  const uint64_t dram_size = opt.bytes("dram-size", 1ull << 30);
  const long threads_opt = opt.integer("threads", 0);
  const std::string dir = opt.str("dir", ".");
  const std::string fio = opt.str("fio", "fio");
  const std::string backend = opt.str("backend", "auto");
  const unsigned threads = threads_opt > 0 ? static_cast<unsigned>(threads_opt)
                                           : std::max(1u, std::thread::hardware_concurrency());
  const uint64_t link_size = std::min<uint64_t>(size, 1ull << 30);

  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = backend_from(backend);
  c.hbm_budget_bytes = 2 * link_size + (64 << 20);
  c.dram_budget_bytes = 2 * link_size + (64 << 20);
  strata_capabilities_t caps;
  strata_runtime_t* rt = open_runtime(c, &caps);
  const bool cuda = caps.device_backend == STRATA_DEVICE_BACKEND_CUDA;
  report->device = std::string(caps.device_name) + " (" +
                   strata_device_backend_name(caps.device_backend) + " backend), " +
                   std::to_string(std::thread::hardware_concurrency()) + " cores";
  void *h1 = nullptr, *h2 = nullptr, *d1 = nullptr, *d2 = nullptr;
  check(strata_tensor_data_pointer(rt, make_tensor(rt, "h1", link_size, STRATA_TIER_DRAM), &h1),
        "ptr");
  check(strata_tensor_data_pointer(rt, make_tensor(rt, "h2", link_size, STRATA_TIER_DRAM), &h2),
        "ptr");
  check(strata_tensor_data_pointer(rt, make_tensor(rt, "d1", link_size, STRATA_TIER_HBM), &d1),
        "ptr");
  check(strata_tensor_data_pointer(rt, make_tensor(rt, "d2", link_size, STRATA_TIER_HBM), &d2),
        "ptr");
  progress("pinned copies");
  CopyTimes pinned;
  std::string error;
  if (!time_peer_copies(cuda, caps.device_ordinal, h1, d1, h2, d2, link_size, 5, &pinned, &error)) {
    throw std::runtime_error(error);
  }
  const double n = static_cast<double>(link_size);
  const std::string how = cuda ? "cudaMemcpyAsync" : "memcpy (host backend)";
  report->add(Result{"pinned_h2d", n / pinned.h2d_seconds / 1e9, "GB/s", "", 0, 0, how});
  report->add(Result{"pinned_d2h", n / pinned.d2h_seconds / 1e9, "GB/s", "", 0, 0, how});
  report->add(Result{"pinned_both", 2 * n / pinned.both_seconds / 1e9, "GB/s", "", 0, 0, how});
  progress("pageable copies");
  std::vector<unsigned char> pageable(link_size, 1);
  const double pageable_s =
      time_pageable_h2d(cuda, caps.device_ordinal, pageable.data(), d1, link_size, 3);
  report->add(
      Result{"pageable_h2d", n / pageable_s / 1e9, "GB/s", "", 0, 0, "from malloc'd memory"});
  check(strata_runtime_destroy(rt), "destroy");

  progress("host memory triad, " + std::to_string(threads) + " threads");
  report->add(Result{"dram_triad", triad_gbps(dram_size, threads, 5), "GB/s", "", 0, 0,
                     std::to_string(threads) + " threads, 2 reads + 1 write per element"});

  if (fio_available(fio)) {
    const std::string file = dir + "/strata-bench-links.bin";
    const int fd = open(file.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0 || posix_fallocate(fd, 0, static_cast<off_t>(size)) != 0) {
      throw std::runtime_error("cannot create " + file);
    }
    close(fd);
    progress("nvme through fio");
    report->add(Result{"nvme_write", run_fio(fio, file, "write", size, 1 << 20, 32) / 1e9, "GB/s",
                       "", 0, 0, "fio io_uring O_DIRECT bs 1M qd 32"});
    report->add(Result{"nvme_read", run_fio(fio, file, "read", size, 1 << 20, 32) / 1e9, "GB/s", "",
                       0, 0, "fio io_uring O_DIRECT bs 1M qd 32"});
    unlink(file.c_str());
  } else {
    progress("fio not found ('" + fio + "'): no NVMe ceilings (install fio or pass --fio)");
  }
  return 0;
}

}  // namespace strata_bench
