// What the placement's source files share beyond placement.h (which declares its API; each
// source file holds one of its jobs). Private to runtime/placement/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>

#include "runtime/placement/placement.h"

namespace strata::placement_detail {

// Whether a layer's update stages through DRAM (a trainable layer with state or weights on
// NVMe), and what it stages and writes back: its NVMe-homed state and weights.
inline uint64_t staged_bytes(const PlacementLayer& l, const LayerHome& h) {
  return (h.state_on_nvme ? l.state_bytes - std::min(l.state_bytes, h.state_in_dram) : 0) +
         (h.weights_on_nvme ? l.weight_bytes : 0);
}
inline bool staged(const PlacementLayer& l, const LayerHome& h) {
  return l.state_bytes > 0 && staged_bytes(l, h) > 0;
}

// Bytes as GiB with two decimals, for messages and the text output.
inline std::string gib(uint64_t bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1ull << 30) << " GiB";
  return o.str();
}

}  // namespace strata::placement_detail
