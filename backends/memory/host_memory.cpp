#include "backends/memory/host_memory.h"

#include <numa.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/spawn.h"

namespace strata {
namespace {

Status apply_numa_policy(void* ptr, uint64_t bytes, const HostMemoryOptions& options,
                         HostMemoryReport* report) {
  const bool numa = numa_available() >= 0;
  const int max_node = numa ? numa_max_node() : 0;
  switch (options.policy) {
    case NumaPolicy::kNode:
      if (options.node < 0 || options.node > max_node) {
        return error(Code::kInvalidArgument, "dram_numa_node ", options.node,
                     " does not exist: this host has NUMA nodes 0..", max_node);
      }
      if (numa) numa_tonode_memory(ptr, bytes, options.node);
      report->node = options.node;
      report->placement = "node " + std::to_string(options.node);
      return Status::ok();
    case NumaPolicy::kInterleave:
      if (numa && max_node > 0) {
        numa_interleave_memory(ptr, bytes, numa_all_nodes_ptr);
        report->placement = "interleaved over " + std::to_string(max_node + 1) + " nodes";
      } else {
        report->placement = "interleave asked, single NUMA node";
      }
      return Status::ok();
    case NumaPolicy::kAuto:
      if (!numa || max_node == 0) {
        report->node = 0;
        report->placement = "node 0 (single NUMA node)";
      } else if (options.preferred_node >= 0 && options.preferred_node <= max_node) {
        numa_tonode_memory(ptr, bytes, options.preferred_node);
        report->node = options.preferred_node;
        report->placement = "node " + std::to_string(options.preferred_node) + " (the GPU's)";
      } else {
        report->placement = "local to the faulting threads (GPU node unknown)";
      }
      return Status::ok();
  }
  return error(Code::kInvalidArgument, "unknown dram_numa_policy ",
               static_cast<int32_t>(options.policy));
}

constexpr uint64_t kMaxFaultThreads = 1024;

}  // namespace

unsigned usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return static_cast<unsigned>(std::max(1, CPU_COUNT(&set)));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace {

// Writing one byte per page makes each page resident (and, with a bound policy, places it).
// The threads take kFaultChunkBytes chunks in address order from one counter, so the resident
// part of the mapping grows from its start, where the concurrent pinning walk follows it
// (host_memory.h); `stop` (a failed pin) ends the fault-in at the next chunk. When a thread
// cannot be started (a pids limit), the calling thread works the counter too: slower, but the
// arena is the same, and no joinable std::thread is ever destroyed. Returns the threads that
// ran (the caller included when it had to help).
unsigned fault_in(unsigned char* base, uint64_t bytes, unsigned threads,
                  const std::atomic<bool>& stop) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t pages = bytes / page;
  threads = static_cast<unsigned>(std::clamp<uint64_t>(
      threads, 1, std::min<uint64_t>(kMaxFaultThreads, std::max<uint64_t>(pages, 1))));
  const uint64_t chunk = std::max<uint64_t>(page, kFaultChunkBytes / page * page);
  const uint64_t chunks = (bytes + chunk - 1) / chunk;
  std::atomic<uint64_t> next{0};
  auto work = [&] {
    for (uint64_t c = next.fetch_add(1, std::memory_order_relaxed);
         c < chunks && !stop.load(std::memory_order_relaxed);
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      const uint64_t end = std::min(bytes, (c + 1) * chunk);
      for (uint64_t at = c * chunk; at < end; at += page) base[at] = 0;
    }
  };
  std::vector<std::thread> workers;
  unsigned t = 0;
  for (; t < threads; ++t) {
    std::thread w;
    if (!spawn_thread("a dram fault-in", work, &w).is_ok()) break;
    workers.push_back(std::move(w));
  }
  if (t < threads) work();  // the threads that never ran: the caller takes their chunks
  for (auto& w : workers) w.join();
  return t < threads ? t + 1 : t;
}
}  // namespace

uint64_t host_available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t value = 0;
  std::string unit;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

Status map_host_memory(uint64_t bytes, const HostMemoryOptions& options, void** out,
                       HostMemoryReport* report, const PinHostMemory& pin) {
  const uint64_t available = host_available_memory();
  if (available != 0 && bytes > available) {
    return error(Code::kOutOfMemory, "dram budget of ", bytes, " bytes exceeds the ", available,
                 " bytes of host memory available (MemAvailable); lower dram_budget_bytes");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return error(Code::kOutOfMemory, "cannot map ", bytes,
                 " bytes for the dram tier: ", std::strerror(err), " (errno ", err, ")");
  }
  *report = HostMemoryReport{};
  report->huge_pages = madvise(p, bytes, MADV_HUGEPAGE) == 0;
  Status placed = apply_numa_policy(p, bytes, options, report);
  if (!placed.is_ok()) {
    munmap(p, bytes);
    return placed;
  }
  const unsigned asked = options.threads != 0 ? options.threads : usable_cores();  // .h: why
  const auto start = std::chrono::steady_clock::now();
  // The pinning call runs beside the fault-in (host_memory.h); `pinned_at` is when it ended,
  // in seconds from `start`.
  Status pinned = Status::ok();
  double pinned_at = 0;
  std::atomic<bool> stop{false};
  auto pin_now = [&] {
    const auto call = std::chrono::steady_clock::now();
    pinned = pin(p, bytes);
    if (!pinned.is_ok()) stop = true;
    report->pin_call_seconds = seconds_since(call);
    pinned_at = seconds_since(start);
  };
  std::thread pinner;
  if (pin) report->pinned_concurrently = spawn_thread("a dram pinning", pin_now, &pinner).is_ok();
  report->threads = fault_in(static_cast<unsigned char*>(p), bytes, asked, stop);
  report->fault_seconds = seconds_since(start);
  if (pin) {
    if (report->pinned_concurrently) {
      pinner.join();
    } else {
      pin_now();  // no thread for it: after the fault-in, as one call all the same
    }
    report->pin_seconds = std::max(0.0, pinned_at - report->fault_seconds);
    if (!pinned.is_ok()) {
      munmap(p, bytes);
      return pinned;
    }
  }
  *out = p;
  return Status::ok();
}

void unmap_host_memory(void* ptr, uint64_t bytes) {
  munmap(ptr, bytes);
}

}  // namespace strata
