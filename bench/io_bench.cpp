// strata-bench io: the storage and PCIe links through Strata, next to their peers in the same
// run. NVMe read/write: a tensor moved DRAM <-> NVMe, against fio on the same file with the same
// block size and queue depth. DRAM <-> HBM: tensors moved by Strata, against cudaMemcpyAsync
// (memcpy on the host backend) between the same buffers. Pinning: the DRAM arena's start-up
// rate, against cudaHostAlloc of the same size.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_options.h"
#include "bench_report.h"
#include "bench_strata.h"
#include "device_peer.h"
#include "fio_peer.h"
#include "strata/strata.h"

namespace strata_bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr double kGB = 1e9;

struct Runtime {
  strata_runtime_t* rt = nullptr;
  ~Runtime() { strata_runtime_destroy(rt); }
};

void fill(strata_runtime_t* rt, strata_tensor_t* t, uint64_t bytes) {
  std::vector<unsigned char> chunk(64 << 20);
  for (std::size_t i = 0; i < chunk.size(); ++i) chunk[i] = static_cast<unsigned char>(i * 131 + 7);
  for (uint64_t off = 0; off < bytes; off += chunk.size()) {
    check(strata_tensor_write(rt, t, off, chunk.data(),
                              std::min<uint64_t>(chunk.size(), bytes - off)),
          "fill");
  }
}

// Wall time of one move, from the call to the event's completion.
double timed_move(strata_runtime_t* rt, strata_tensor_t* t, strata_tier_t dst) {
  strata_event_t* e = nullptr;
  const auto start = Clock::now();
  check(strata_tensor_move(rt, t, dst, nullptr, &e), "move");
  const strata_status_t s = strata_event_wait(e, -1);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  strata_event_destroy(e);
  check(s, "move completion");
  return seconds;
}

double timed_pair(strata_runtime_t* rt, strata_tensor_t* a, strata_tier_t a_dst, strata_tensor_t* b,
                  strata_tier_t b_dst) {
  strata_event_t* ea = nullptr;
  strata_event_t* eb = nullptr;
  const auto start = Clock::now();
  check(strata_tensor_move(rt, a, a_dst, nullptr, &ea), "move");
  check(strata_tensor_move(rt, b, b_dst, nullptr, &eb), "move");
  const strata_status_t sa = strata_event_wait(ea, -1);
  const strata_status_t sb = strata_event_wait(eb, -1);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  strata_event_destroy(ea);
  strata_event_destroy(eb);
  check(sa, "move completion");
  check(sb, "move completion");
  return seconds;
}

}  // namespace

int run_io(const Options& opt, Report* report) {
  const uint64_t size = opt.bytes("size", 1ull << 30);
  const uint64_t block = opt.bytes("block", 1 << 20);
  const auto depth = static_cast<unsigned>(opt.integer("qd", 32));
  const int reps = static_cast<int>(opt.integer("reps", 3));
  const uint64_t link_size = opt.bytes("link-size", 256ull << 20);
  const std::string dir = opt.str("dir", ".");
  const std::string fio = opt.str("fio", "fio");
  const std::string engine = opt.str("engine", "auto");
  const std::string backend = opt.str("backend", "auto");
  const bool skip_nvme = opt.flag("no-nvme");
  const bool dram_direct = opt.flag("dram-direct");
  const bool checksums = opt.flag("checksums");
  if (reps < 1 || depth < 1) throw std::invalid_argument("--reps and --qd must be >= 1");

  const std::string file = dir + "/strata-bench-io.bin";
  // Created here so the runtime keeps it (it removes only files it created); fio reuses it.
  if (!skip_nvme) {
    const int fd = open(file.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) throw std::runtime_error("cannot create " + file + ": " + std::strerror(errno));
    close(fd);
  }
  const char* paths[1] = {file.c_str()};
  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = backend_from(backend);
  c.hbm_budget_bytes = std::max(2 * link_size, skip_nvme ? 0 : size) + (64 << 20);
  c.dram_budget_bytes = std::max(size, 2 * link_size) + (64 << 20);
  if (!skip_nvme) {
    c.nvme_paths = paths;
    c.nvme_path_count = 1;
    c.nvme_budget_bytes = size;
    c.io_engine = engine == "uring"   ? STRATA_IO_ENGINE_URING
                  : engine == "posix" ? STRATA_IO_ENGINE_POSIX
                                      : STRATA_IO_ENGINE_AUTO;
    c.io_block_size = static_cast<uint32_t>(block);
    c.io_queue_depth = depth;
    c.io_dram_direct = dram_direct ? 1 : 0;
    c.nvme_checksums = checksums ? 1 : 0;
  }
  Runtime r;
  strata_capabilities_t caps;
  r.rt = open_runtime(c, &caps);
  const bool cuda = caps.device_backend == STRATA_DEVICE_BACKEND_CUDA;
  report->device = std::string(caps.device_name) + " (" +
                   strata_device_backend_name(caps.device_backend) + " backend" +
                   (skip_nvme ? ""
                              : std::string(", ") + caps.io_engine +
                                    (dram_direct ? ", direct dram" : ", staged dram") +
                                    (checksums ? ", crc32c" : "")) +
                   ")";

  // Pinning rate of the DRAM arena vs cudaHostAlloc of the same size.
  const double pin_seconds = caps.dram_fault_seconds + caps.dram_pin_seconds;
  const double pin_rate = static_cast<double>(c.dram_budget_bytes) / pin_seconds / kGB;
  const double peer_pin =
      cuda ? time_cuda_host_alloc(caps.device_ordinal, c.dram_budget_bytes) : -1;
  if (peer_pin > 0) {
    report->add_vs("dram_pin_rate", pin_rate, "GB/s", "cudaHostAlloc",
                   static_cast<double>(c.dram_budget_bytes) / peer_pin / kGB, false,
                   caps.dram_placement);
  } else {
    report->add(Result{"dram_pin_rate", pin_rate, "GB/s", "", 0, 0, caps.dram_placement});
  }

  if (!skip_nvme) {
    strata_tensor_t* t = make_tensor(r.rt, "io", size, STRATA_TIER_DRAM);
    fill(r.rt, t, size);
    const bool have_fio = fio_available(fio);
    if (!have_fio) progress("fio not found ('" + fio + "'): NVMe results have no peer");
    // Strata and fio alternate within each repetition, so drift in the device (caches, thermal
    // state, a virtual disk's write-back) hits both alike. fio reuses Strata's file region.
    std::vector<double> writes, reads, fio_writes, fio_reads, staged_writes, staged_reads;
    for (int i = 0; i < reps; ++i) {
      progress("nvme write/read, strata and fio, rep " + std::to_string(i + 1) + "/" +
               std::to_string(reps));
      // Strata reads back what it wrote (fio in between would break --checksums).
      writes.push_back(static_cast<double>(size) / timed_move(r.rt, t, STRATA_TIER_NVME));
      reads.push_back(static_cast<double>(size) / timed_move(r.rt, t, STRATA_TIER_DRAM));
      if (have_fio) fio_writes.push_back(run_fio(fio, file, "write", size, block, depth));
      if (have_fio) fio_reads.push_back(run_fio(fio, file, "read", size, block, depth));
      // HBM <-> NVMe, pipelined through the pinned staging slots.
      timed_move(r.rt, t, STRATA_TIER_HBM);
      staged_writes.push_back(static_cast<double>(size) / timed_move(r.rt, t, STRATA_TIER_NVME));
      staged_reads.push_back(static_cast<double>(size) / timed_move(r.rt, t, STRATA_TIER_HBM));
      timed_move(r.rt, t, STRATA_TIER_DRAM);
    }
    const double strata_write = median(writes) / kGB;
    const double strata_read = median(reads) / kGB;
    const std::string settings =
        "bs " + std::to_string(block >> 10) + "K qd " + std::to_string(depth);
    if (have_fio) {
      report->add_vs("nvme_write", strata_write, "GB/s", "fio io_uring " + settings,
                     median(fio_writes) / kGB);
      report->add_vs("nvme_read", strata_read, "GB/s", "fio io_uring " + settings,
                     median(fio_reads) / kGB);
      report->add_vs("nvme_write_from_hbm", median(staged_writes) / kGB, "GB/s",
                     "fio io_uring " + settings, median(fio_writes) / kGB);
      report->add_vs("nvme_read_to_hbm", median(staged_reads) / kGB, "GB/s",
                     "fio io_uring " + settings, median(fio_reads) / kGB);
    } else {
      report->add(Result{"nvme_write", strata_write, "GB/s", "", 0, 0, "no fio"});
      report->add(Result{"nvme_read", strata_read, "GB/s", "", 0, 0, "no fio"});
      report->add(
          Result{"nvme_write_from_hbm", median(staged_writes) / kGB, "GB/s", "", 0, 0, "no fio"});
      report->add(
          Result{"nvme_read_to_hbm", median(staged_reads) / kGB, "GB/s", "", 0, 0, "no fio"});
    }
    check(strata_tensor_unregister(r.rt, t), "unregister");
  }

  // DRAM <-> HBM: Strata moves, then the peer between the same buffers.
  strata_tensor_t* a = make_tensor(r.rt, "link.a", link_size, STRATA_TIER_DRAM);
  strata_tensor_t* b = make_tensor(r.rt, "link.b", link_size, STRATA_TIER_HBM);
  fill(r.rt, a, link_size);
  std::vector<double> h2d, d2h, both;
  for (int i = 0; i < std::max(reps, 5); ++i) {
    progress("dram <-> hbm through strata, rep " + std::to_string(i + 1));
    h2d.push_back(static_cast<double>(link_size) / timed_move(r.rt, a, STRATA_TIER_HBM));
    d2h.push_back(static_cast<double>(link_size) / timed_move(r.rt, a, STRATA_TIER_DRAM));
    both.push_back(2.0 * static_cast<double>(link_size) /
                   timed_pair(r.rt, a, STRATA_TIER_HBM, b, STRATA_TIER_DRAM));
    timed_pair(r.rt, a, STRATA_TIER_DRAM, b, STRATA_TIER_HBM);  // back where they were
  }
  void* host = nullptr;
  void* device = nullptr;
  void* host2 = nullptr;
  void* device2 = nullptr;
  strata_tensor_t* a2 = make_tensor(r.rt, "link.a2", link_size, STRATA_TIER_HBM);
  strata_tensor_t* b2 = make_tensor(r.rt, "link.b2", link_size, STRATA_TIER_DRAM);
  check(strata_tensor_data_pointer(r.rt, a, &host), "pointer");
  check(strata_tensor_data_pointer(r.rt, a2, &device), "pointer");
  check(strata_tensor_data_pointer(r.rt, b2, &host2), "pointer");
  check(strata_tensor_data_pointer(r.rt, b, &device2), "pointer");
  progress(std::string("dram <-> hbm through ") + (cuda ? "cudaMemcpyAsync" : "memcpy"));
  CopyTimes peer;
  std::string error;
  if (!time_peer_copies(cuda, caps.device_ordinal, host, device, host2, device2, link_size,
                        std::max(reps, 5), &peer, &error)) {
    throw std::runtime_error("peer copies failed: " + error);
  }
  const std::string peer_name = cuda ? "cudaMemcpyAsync" : "memcpy (1 thread)";
  const double n = static_cast<double>(link_size);
  report->add_vs("h2d", median(h2d) / kGB, "GB/s", peer_name, n / peer.h2d_seconds / kGB);
  report->add_vs("d2h", median(d2h) / kGB, "GB/s", peer_name, n / peer.d2h_seconds / kGB);
  report->add_vs("h2d_d2h_both", median(both) / kGB, "GB/s", peer_name,
                 2 * n / peer.both_seconds / kGB);
  if (!skip_nvme) unlink(file.c_str());
  return 0;
}

}  // namespace strata_bench
