// What the tests of NVMe-homed optimizer state (test_nvme_state.cpp, test_nvme_accumulators.cpp)
// share: a runtime config with an NVMe tier, the tier a param's state lives in, and an executor
// step stopped at its first failing call.
#pragma once

#include <string>

#include "optimizer/optimizer_model.h"
#include "support/device_views.h"
#include "support/scratch_dir.h"

namespace strata_test {

// A runtime with an NVMe tier of `nvme` bytes in `scratch` (checksums on, the default).
struct NvmeConfig {
  std::string file;
  const char* paths[1];
  strata_runtime_config_t config;
  NvmeConfig(const ScratchDir& scratch, uint64_t dram, uint64_t nvme) {
    file = scratch.file("tier");
    paths[0] = file.c_str();
    config = config_for(backend_under_test(), 64 * kMiB, dram);
    config.nvme_paths = paths;
    config.nvme_path_count = 1;
    config.nvme_budget_bytes = nvme;
  }
};

inline strata_tier_t state_tier(Model& m, strata_optimizer_t* o, strata_tensor_t* w,
                                strata_state_kind_t kind) {
  strata_tensor_t* s = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_get_state(o, w, kind, &s));
  strata_tier_t tier = -1;
  STRATA_REQUIRE_OK(strata_tensor_tier(m.rt.get(), s, &tier));
  return tier;
}

// One executor step over `layers` layers with no compute, stopped at the first call that
// fails (then abandoned with step_abort): that call's status and message, or STRATA_OK.
inline strata_status_t step_until_failure(strata_executor_t* ex, uint32_t layers,
                                          std::string* message) {
  strata_status_t first = STRATA_OK;
  auto note = [&](strata_status_t s) {
    if (first == STRATA_OK && s != STRATA_OK) {
      first = s;
      *message = strata_last_error_message();
    }
    return s == STRATA_OK;
  };
  bool ok = note(strata_step_begin(ex));
  strata_layer_views_t v{};
  v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
  for (uint32_t l = 0; ok && l < layers; ++l) {
    ok = note(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, 0, &v)) &&
         note(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
  }
  for (uint32_t l = layers; ok && l-- > 0;) {
    ok = note(strata_layer_acquire(ex, l, STRATA_PHASE_BACKWARD, nullptr, 0, &v)) &&
         note(strata_layer_release(ex, l, STRATA_PHASE_BACKWARD, nullptr));
  }
  if (ok) ok = note(strata_step_end(ex));
  if (!ok) (void)strata_step_abort(ex, nullptr);
  return first;
}

}  // namespace strata_test
