// IEEE binary16 <-> binary32 in integer operations, bit for bit what F16C's vcvtps2ph (round to
// nearest even) and vcvtph2ps give, NaNs quieted. The optimizer kernels store fp16 as
// _Float16, which GCC 12 and clang >= 15 support on x86; clang 14 does not (and its __fp16
// needs compiler-rt's helpers without F16C), so kernels_impl.h falls back to these there.
// tests/optimizer/test_kernels.cpp checks them against _Float16 over every half and a sweep
// of floats.
#pragma once

#include <bit>
#include <cstdint>

namespace strata::optim {

constexpr uint16_t half_from_float(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (a < 0x38800000u) {                                               // below 2^-14: subnormal
    const uint32_t e = a >> 23;
    if (e < 102) return sign;  // below 2^-25 (2^-25 itself ties to 0 below)
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24: to units of 2^-24
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = a - 0x38000000u;  // rebias the exponent from 127 to 15
  uint32_t q = r >> 13;
  const uint32_t rem = r & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | q);
}

constexpr float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) {
    return std::bit_cast<float>(sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  }
  if (e == 0) {
    const float f = static_cast<float>(m) * 0x1p-24f;  // exact
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(f));
  }
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

}  // namespace strata::optim
