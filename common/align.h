// Rounding to alignments: arena blocks, NVMe extents (O_DIRECT's 4 KiB) and the planner's slots.
#pragma once

#include <cstdint>
#include <limits>

namespace strata {

// `value` rounded up to a multiple of `alignment` (> 0); 0 when the result does not fit in 64
// bits, so a caller's size check fails instead of wrapping to a small size.
constexpr uint64_t align_up(uint64_t value, uint64_t alignment) {
  if (value > std::numeric_limits<uint64_t>::max() - (alignment - 1)) return 0;
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace strata
