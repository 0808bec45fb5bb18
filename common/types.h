// Core vocabulary: tiers, dtypes, roles, links. Values mirror strata.h's STRATA_* constants
// (lib/abi_mirrors.cpp static_asserts each) so the ABI layer converts by a checked cast.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

enum class Tier : int32_t { kHbm = 0, kDram = 1, kNvme = 2 };
inline constexpr int kTierCount = 3;

enum class DType : int32_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 2,
  kF64 = 3,
  kI8 = 4,
  kU8 = 5,
  kI16 = 6,
  kI32 = 7,
  kI64 = 8,
  kBool = 9,
};
inline constexpr int kDTypeCount = 10;

enum class Role : int32_t {
  kWeight = 0,
  kGrad = 1,
  kOptimizerState = 2,
  kActivation = 3,
  kOther = 4
};
inline constexpr int kRoleCount = 5;

// One direction of data movement between two tiers.
enum class Link : int32_t { kH2D = 0, kD2H = 1, kNvmeRead = 2, kNvmeWrite = 3 };
inline constexpr int kLinkCount = 4;

std::string_view tier_name(Tier tier);
std::string_view dtype_name(DType dtype);
std::string_view role_name(Role role);
std::string_view link_name(Link link);
// Bytes per element; 0 for a value out of range.
std::size_t dtype_size(DType dtype);

inline bool valid_tier(int32_t v) {
  return v >= 0 && v < kTierCount;
}
inline bool valid_dtype(int32_t v) {
  return v >= 0 && v < kDTypeCount;
}
inline bool valid_role(int32_t v) {
  return v >= 0 && v < kRoleCount;
}
inline bool valid_link(int32_t v) {
  return v >= 0 && v < kLinkCount;
}

}  // namespace strata
