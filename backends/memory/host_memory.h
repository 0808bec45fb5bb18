// Host memory for the DRAM tier: one anonymous mapping, huge pages requested, placed on a NUMA
// node (or interleaved) with libnuma before any page exists, then faulted in by several threads
// at once so the pages are resident before the device backend pins them.
//
// Why fault in parallel before pinning: making pages resident (fault + zero) is most of what
// pinning costs, it is single-threaded inside cudaHostRegister, and it parallelizes well from
// user threads; registering already-resident pages then only has to lock and map them.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace strata {

enum class NumaPolicy : int32_t { kAuto = 0, kNode = 1, kInterleave = 2 };

struct HostMemoryOptions {
  NumaPolicy policy = NumaPolicy::kAuto;
  int node = -1;            // for kNode
  int preferred_node = -1;  // the GPU's node, used by kAuto; -1 if unknown
  unsigned threads = 0;     // fault-in threads; 0 = one per core, at most 16; never above 1024
};

struct HostMemoryReport {
  std::string placement;  // "node 0", "interleaved over 2 nodes", "local (single NUMA node)"
  int node = -1;          // the node the pages were bound to; -1 if interleaved or unbound
  bool huge_pages = false;
  double fault_seconds = 0;
  unsigned threads = 0;
};

// Maps and faults in `bytes` (a multiple of the page size). kOutOfMemory if the host does not
// have that much available memory (checked before any page is touched, so an oversized budget
// is an error, never an OOM kill); kInvalidArgument for a node that does not exist.
Status map_host_memory(uint64_t bytes, const HostMemoryOptions& options, void** out,
                       HostMemoryReport* report);
void unmap_host_memory(void* ptr, uint64_t bytes);

// MemAvailable from /proc/meminfo in bytes; 0 if it cannot be read.
uint64_t host_available_memory();

}  // namespace strata
