#include "common/types.h"

#include <array>

namespace strata {

namespace {
constexpr std::array<std::string_view, kTierCount> kTierNames = {"hbm", "dram", "nvme"};
constexpr std::array<std::string_view, kDTypeCount> kDTypeNames = {
    "f32", "f16", "bf16", "f64", "i8", "u8", "i16", "i32", "i64", "bool"};
constexpr std::array<std::size_t, kDTypeCount> kDTypeSizes = {4, 2, 2, 8, 1, 1, 2, 4, 8, 1};
constexpr std::array<std::string_view, kRoleCount> kRoleNames = {
    "weight", "grad", "optimizer_state", "activation", "other"};
constexpr std::array<std::string_view, kLinkCount> kLinkNames = {"h2d", "d2h", "nvme_read",
                                                                 "nvme_write"};

template <typename Enum, std::size_t N>
std::string_view lookup(const std::array<std::string_view, N>& names, Enum value) {
  const auto index = static_cast<int32_t>(value);
  return index >= 0 && static_cast<std::size_t>(index) < N ? names[index] : "unknown";
}
}  // namespace

std::string_view tier_name(Tier tier) {
  return lookup(kTierNames, tier);
}
std::string_view dtype_name(DType dtype) {
  return lookup(kDTypeNames, dtype);
}
std::string_view role_name(Role role) {
  return lookup(kRoleNames, role);
}
std::string_view link_name(Link link) {
  return lookup(kLinkNames, link);
}

std::size_t dtype_size(DType dtype) {
  const auto index = static_cast<int32_t>(dtype);
  return valid_dtype(index) ? kDTypeSizes[index] : 0;
}

}  // namespace strata
