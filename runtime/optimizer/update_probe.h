// How fast this host runs the optimizer's update: AdamW over a scratch parameter, on the
// threads an optimizer would use, for a placement's prediction (runtime/placement/placement.h).
#pragma once

#include "common/status.h"
#include "runtime/runtime.h"

namespace strata::optim {

// Elements per second of an AdamW update (bf16 grad and working copy, fp32 master and
// moments: what a streamed layer's update touches) on `threads` threads (0 = the CPUs of
// `numa_node` less one, an optimizer's default) bound to `numa_node` (< 0: none). Takes about a
// second and 1 GiB of memory. Errors: kOutOfMemory (threads or memory refused).
Status measure_update_rate(unsigned threads, int numa_node, double* elements_per_second);

// The same on the runtime's DRAM arena (a scratch tensor in its free space, given back after):
// the measurement stays inside the DRAM budget (host_budget is a promise: docs/optimizer.md),
// with fewer elements where the arena's largest free block holds less than 1 GiB of arrays (a
// model whose budget is that small has layers the caches hold too); below 16 MiB, on 16 MiB of
// heap it frees at once.
Status measure_update_rate(Runtime& runtime, double* elements_per_second);

}  // namespace strata::optim
