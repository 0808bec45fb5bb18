// What the optimizer kernels' tests (test_kernels*.cpp) share: bf16 conversions as torch
// rounds, the instruction sets this CPU runs, and the closeness check against a float64
// reference.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "runtime/optimizer/kernels.h"

namespace strata::optim::testing {

inline uint16_t to_bf16(float x) {  // round to nearest even, as torch's .to(torch.bfloat16)
  const uint32_t u = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float from_bf16(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline std::vector<Isa> isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::kGeneric, Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(i)) out.push_back(i);
  }
  return out;
}

// |x - ref| <= rel * max(|ref|, rms(ref)): relative to the element, or to the tensor's RMS for
// elements that cancelled to near zero (there fp32 keeps absolute, not relative, accuracy; a
// weight crossing zero would otherwise fail any relative bound). The worst ratio is reported.
inline void require_close(const std::vector<float>& x, const std::vector<double>& ref, double rel,
                          const char* what) {
  double sq = 0;
  for (double r : ref) sq += r * r;
  const double rms = std::sqrt(sq / static_cast<double>(ref.size()));
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double err = std::abs(static_cast<double>(x[i]) - ref[i]);
    const double ratio = err / std::max(std::abs(ref[i]), rms);
    if (ratio > worst) {
      worst = ratio;
      at = i;
    }
  }
  INFO(what << ": worst relative error " << worst << " at " << at << " (" << x[at] << " vs "
            << ref[at] << ", rms " << rms << ")");
  REQUIRE(worst <= rel);
}

}  // namespace strata::optim::testing
