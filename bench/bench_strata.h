// Small helpers every strata-bench subcommand uses on the C ABI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/strata.h"

namespace strata_bench {

// Throws std::runtime_error with the status and the library's message unless `s` is OK.
void check(strata_status_t s, const char* what);
// The median of `v` (not empty).
double median(std::vector<double> v);
// A 1-D tensor of `bytes` bytes (u8, or bf16 when `bytes` is even and `bf16` is set).
strata_tensor_t* make_tensor(strata_runtime_t* rt, const std::string& name, uint64_t bytes,
                             strata_tier_t home, bool bf16 = false);
// Creates a runtime (saying how much it pins first: that is the slow part) and describes it.
strata_runtime_t* open_runtime(const strata_runtime_config_t& config, strata_capabilities_t* caps);
// "auto", "cuda" or "host" as a backend constant; throws on anything else.
strata_device_backend_t backend_from(const std::string& name);

}  // namespace strata_bench
