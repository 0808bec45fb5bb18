// What the bad-input tests (test_bad_input*.cpp) share: a host runtime of 64 MiB per tier.
#pragma once

#include <cstdint>

#include "support/test_support.h"

namespace strata_test::bad_input {

inline constexpr uint64_t kMiB = 1ull << 20;

inline RuntimePtr host_runtime(uint64_t host_bps = 0) {
  return make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 64 * kMiB, 64 * kMiB, host_bps));
}

}  // namespace strata_test::bad_input
