// Host memory for the DRAM tier: one anonymous mapping, huge pages requested, placed on a NUMA
// node (or interleaved) with libnuma before any page exists, then faulted in by several threads
// at once while the device backend pins it.
//
// Why fault in parallel: making pages resident (fault + zero) is most of what pinning costs, it
// is single-threaded inside cudaHostRegister, and it parallelizes well from user threads;
// registering resident pages then only has to lock and map them.
//
// Why pin while faulting, not after: the two passes used to run one after the other (an 8B's
// 68 GB arena on an H200 host: 8.8 s of fault-in, then 5.5 s of pinning). The fault-in threads
// take fixed-size chunks in address order from one counter, so the faulted part of the mapping
// grows from its start; one more thread makes the single pinning call over the whole mapping at
// the same time, and the pinning walk (the driver locks pages from the start upwards) finds the
// pages ahead of it already resident, except at the frontier, where it faults the odd page
// itself. The set-up then takes about as long as the longer of the two instead of their sum.
// Why one thread per core: on the virtual machines we run on, the first touch of guest memory
// the hypervisor has not backed yet costs ~0.2-0.5 GB/s per faulting thread (0.2-0.41 GB/s for
// one thread on a 2-core Firecracker guest, 8.6 GB/s on memory touched before; an H200 host's
// 16 threads faulted 68 GB at 7.7 GB/s, 0.48 each), far below memory bandwidth: the cost is per
// fault, and more threads should fault more at once. The cap of 16 threads this replaced left
// 48 of a 64-core host's cores idle for a 390 GB arena (bench/setup_bench.py measures it).
// One call over the whole mapping, never one per chunk: CUDA refuses (or stages as pageable)
// a copy whose host range spans two registrations, and an arena block may straddle any chunk.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"

namespace strata {

enum class NumaPolicy : int32_t { kAuto = 0, kNode = 1, kInterleave = 2 };

struct HostMemoryOptions {
  NumaPolicy policy = NumaPolicy::kAuto;
  int node = -1;            // for kNode
  int preferred_node = -1;  // the GPU's node, used by kAuto; -1 if unknown
  unsigned threads = 0;     // fault-in threads; 0 = one per core of the affinity; at most 1024
};

// Pins (registers for DMA) the whole mapping; called once, on its own thread while the fault-in
// runs (or on the calling thread after it, when that thread cannot be started).
using PinHostMemory = std::function<Status(void* ptr, uint64_t bytes)>;

struct HostMemoryReport {
  std::string placement;  // "node 0", "interleaved over 2 nodes", "local (single NUMA node)"
  int node = -1;          // the node the pages were bound to; -1 if interleaved or unbound
  bool huge_pages = false;
  // Wall time of the fault-in threads, from the first to the last.
  double fault_seconds = 0;
  // What pinning added after the fault-in ended (0 when it ended first, or nothing was pinned):
  // fault_seconds + pin_seconds is the whole set-up.
  double pin_seconds = 0;
  // The pinning call's own duration, overlapping the fault-in (0 when nothing was pinned).
  double pin_call_seconds = 0;
  unsigned threads = 0;
  bool pinned_concurrently = false;  // false: the pinning thread was refused, pinned after
};

// Bytes each fault-in thread takes from the counter at a time: large against the per-chunk
// cost (one atomic increment), small enough that the faulted part of the mapping stays one
// contiguous prefix give or take threads x chunk (a 68 GB arena is 2,000 chunks).
inline constexpr uint64_t kFaultChunkBytes = 32ull << 20;

// Maps, places and faults in `bytes` (a multiple of the page size), pinning it with `pin` (if
// given) at the same time. kOutOfMemory if the host does not have that much available memory
// (checked before any page is touched, so an oversized budget is an error, never an OOM kill);
// kInvalidArgument for a node that does not exist; `pin`'s error if it fails (the mapping is
// then released). Every byte reads zero on return.
Status map_host_memory(uint64_t bytes, const HostMemoryOptions& options, void** out,
                       HostMemoryReport* report, const PinHostMemory& pin = {});
void unmap_host_memory(void* ptr, uint64_t bytes);

// The cores this process may run on (its affinity: a container's or a rank's share), not the
// machine's: k processes of one host each faulting with every core's worth of threads would
// oversubscribe it k times. The default count of fault-in threads.
unsigned usable_cores();

// MemAvailable from /proc/meminfo in bytes; 0 if it cannot be read.
uint64_t host_available_memory();

}  // namespace strata
