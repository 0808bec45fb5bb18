// The plain-CUDA peers strata-bench measures Strata against, in the same run: cudaMemcpyAsync
// between the same buffers, and cudaHostAlloc for the pinning rate. On builds or machines
// without CUDA, a single-threaded memcpy (what the host backend's copy engine does) and no
// pinning peer.
#pragma once

#include <cstdint>
#include <string>

namespace strata_bench {

struct CopyTimes {
  double h2d_seconds = 0;
  double d2h_seconds = 0;
  double both_seconds = 0;  // one copy each way at once
};

// Times `reps` copies of `bytes` between host buffer `host` and device buffer `device` (and a
// second pair for the bidirectional run); returns the median of each. `cuda` selects the peer.
bool time_peer_copies(bool cuda, int ordinal, void* host, void* device, void* host2, void* device2,
                      uint64_t bytes, int reps, CopyTimes* out, std::string* error);

// Median seconds of a synchronous copy of `bytes` from pageable host memory to `device`
// (cudaMemcpy on cuda, memcpy on host).
double time_pageable_h2d(bool cuda, int ordinal, const void* host, void* device, uint64_t bytes,
                         int reps);

// Seconds cudaHostAlloc takes to allocate and pin `bytes` (freed afterwards); <0 if unavailable.
double time_cuda_host_alloc(int ordinal, uint64_t bytes);

}  // namespace strata_bench
