// The host-memory ceiling: a multi-threaded STREAM triad (a = b + s * c over float arrays),
// counted as STREAM counts it (two reads and a write per element, write-allocate traffic not
// included), so kernels compared with it are counted the same way. The arrays sit at different
// offsets within a page, as STREAM's OFFSET places them.
#pragma once

#include <cstdint>

namespace strata_bench {

// Best of `reps` passes, in GB/s, with `threads` threads over arrays of `bytes_per_array`.
double triad_gbps(uint64_t bytes_per_array, unsigned threads, int reps);

}  // namespace strata_bench
