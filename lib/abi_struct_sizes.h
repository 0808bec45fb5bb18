// The struct_size values the C ABI accepts, one row per argument struct: every size a released
// header's STRATA_*_STRUCT_SIZE gave it (and one sizeof the 1.1 Python package passes), oldest
// first, ending with this header's. read_struct()
// and check_out_struct() (abi_support.h) take a row's sizes and anything at least this header's
// size (a newer caller's: the library reads and writes only the fields it knows); every other
// size ends inside a field or between releases, and is refused (docs/abi.md, "struct_size
// versioning"). A struct without a row does not compile through those helpers, so a new struct
// cannot skip the rule.
#pragma once

#include <cstddef>
#include <iterator>

#include "strata/strata.h"

namespace strata::abi {

template <typename T>
struct StructSizes;  // no definition: only the rows below exist

// A row: the struct's name (for messages), this header's size (its STRATA_*_STRUCT_SIZE) and the
// sizes of older releases before it. A release's size is its header's macro, written as the
// struct's last field then (fields never move, so it stays exact).
#define STRATA_ABI_STRUCT_SIZES(type, current, ...)                                  \
  template <>                                                                        \
  struct StructSizes<type> {                                                         \
    static constexpr const char* kName = #type;                                      \
    static constexpr std::size_t kCurrent = current;                                 \
    static constexpr std::size_t kAccepted[] = {__VA_ARGS__ __VA_OPT__(, ) current}; \
  }

// Sizes older releases' callers still pass (their init compat symbols write these too).
// 1.0 .. 1.4, before 1.5 appended dram_pinned_bytes: 96 bytes.
inline constexpr std::size_t kRuntimeConfigV1_0Size =
    STRATA_STRUCT_SIZE(strata_runtime_config_t, io_dram_direct);
// 1.0, before 1.1's update_mode: 76 bytes (sizeof 80).
inline constexpr std::size_t kOptimizerConfigV1_0Size =
    STRATA_STRUCT_SIZE(strata_optimizer_config_t, threads);
// 1.1, before 1.2's state_placement and nvme_staging_bytes: 80 bytes.
inline constexpr std::size_t kOptimizerConfigV1_1Size =
    STRATA_STRUCT_SIZE(strata_optimizer_config_t, update_mode);
// 1.3 and 1.4, before 1.5's grad_sum: 80 bytes.
inline constexpr std::size_t kLayoutRequestV1_3Size =
    STRATA_STRUCT_SIZE(strata_layout_request_t, nvme_budget_bytes);

// Input structs (the library reads them).
STRATA_ABI_STRUCT_SIZES(strata_runtime_config_t, STRATA_RUNTIME_CONFIG_STRUCT_SIZE,
                        kRuntimeConfigV1_0Size);
STRATA_ABI_STRUCT_SIZES(strata_tensor_desc_t, STRATA_TENSOR_DESC_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_layer_desc_t, STRATA_LAYER_DESC_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_plan_config_t, STRATA_PLAN_CONFIG_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_optimizer_config_t, STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE,
                        kOptimizerConfigV1_0Size, kOptimizerConfigV1_1Size);
// 1.0 and 1.1 end at group (28 bytes), 1.2 .. 1.4 at master_layout (32); 1.5 appended grad_sum.
STRATA_ABI_STRUCT_SIZES(strata_param_desc_t, STRATA_PARAM_DESC_STRUCT_SIZE,
                        STRATA_STRUCT_SIZE(strata_param_desc_t, group),
                        STRATA_STRUCT_SIZE(strata_param_desc_t, master_layout));
STRATA_ABI_STRUCT_SIZES(strata_group_hyperparams_t, STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_trace_config_t, STRATA_TRACE_CONFIG_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_placement_layer_t, STRATA_PLACEMENT_LAYER_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_placement_request_t, STRATA_PLACEMENT_REQUEST_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_layout_request_t, STRATA_LAYOUT_REQUEST_STRUCT_SIZE,
                        kLayoutRequestV1_3Size);
// The step plan's structs are new in the unreleased 1.5: appended to in place (the sequence
// tiles', the optimizer state's tier's and the transfers' fields), they have no older size to
// accept.
STRATA_ABI_STRUCT_SIZES(strata_step_profile_t, STRATA_STEP_PROFILE_STRUCT_SIZE);
// Read in a profile, written by strata_step_plan_get_block.
STRATA_ABI_STRUCT_SIZES(strata_step_block_t, STRATA_STEP_BLOCK_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_step_interval_t, STRATA_STEP_INTERVAL_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_host_buffer_desc_t, STRATA_HOST_BUFFER_DESC_STRUCT_SIZE);

// Output structs (the library writes at most struct_size bytes of them).
// 1.0 .. 1.4 end at io_engine_reason (816 bytes); 1.5 appended dram_pinned_bytes.
STRATA_ABI_STRUCT_SIZES(strata_capabilities_t, STRATA_CAPABILITIES_STRUCT_SIZE,
                        STRATA_STRUCT_SIZE(strata_capabilities_t, io_engine_reason));
// 1.0 .. 1.4 end at tensor_count (40 bytes); 1.5 appended the pinned arena's fields.
STRATA_ABI_STRUCT_SIZES(strata_tier_usage_t, STRATA_TIER_USAGE_STRUCT_SIZE,
                        STRATA_STRUCT_SIZE(strata_tier_usage_t, tensor_count));
STRATA_ABI_STRUCT_SIZES(strata_link_stats_t, STRATA_LINK_STATS_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_tensor_info_t, STRATA_TENSOR_INFO_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_plan_info_t, STRATA_PLAN_INFO_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_layer_views_t, STRATA_LAYER_VIEWS_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_executor_stats_t, STRATA_EXECUTOR_STATS_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_grad_info_t, STRATA_GRAD_INFO_STRUCT_SIZE);
// 1.0 and 1.1 end at binding (132 bytes); 1.2 appended the NVMe state's fields. 136 is 1.1's
// sizeof, which the 1.1 Python package passes (ctypes.sizeof): it ends in padding before 1.2's
// first field (8-aligned at 136), so no field is cut.
STRATA_ABI_STRUCT_SIZES(strata_optimizer_stats_t, STRATA_OPTIMIZER_STATS_STRUCT_SIZE,
                        STRATA_STRUCT_SIZE(strata_optimizer_stats_t, binding),
                        offsetof(strata_optimizer_stats_t, nvme_state_bytes));
STRATA_ABI_STRUCT_SIZES(strata_trace_counters_t, STRATA_TRACE_COUNTERS_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_placement_info_t, STRATA_PLACEMENT_INFO_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_layout_layer_t, STRATA_LAYOUT_LAYER_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_step_plan_info_t, STRATA_STEP_PLAN_INFO_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_host_usage_t, STRATA_HOST_USAGE_STRUCT_SIZE);
STRATA_ABI_STRUCT_SIZES(strata_host_buffer_info_t, STRATA_HOST_BUFFER_INFO_STRUCT_SIZE);
// 1.3 ends at nvme_placeable_bytes (128 bytes), 1.4 at accum_bytes (136); 1.5 appended
// dram_gpu_bytes.
STRATA_ABI_STRUCT_SIZES(strata_layout_totals_t, STRATA_LAYOUT_TOTALS_STRUCT_SIZE,
                        STRATA_STRUCT_SIZE(strata_layout_totals_t, nvme_placeable_bytes),
                        STRATA_STRUCT_SIZE(strata_layout_totals_t, accum_bytes));

#undef STRATA_ABI_STRUCT_SIZES

// A row is oldest first, each size a field boundary inside the struct; checked where used.
template <typename T>
constexpr bool well_formed_sizes() {
  const auto& sizes = StructSizes<T>::kAccepted;
  if (sizes[0] <= sizeof(std::size_t)) return false;  // struct_size alone is no struct
  for (std::size_t i = 1; i < std::size(sizes); ++i) {
    if (sizes[i] <= sizes[i - 1]) return false;
  }
  return StructSizes<T>::kCurrent <= sizeof(T);
}

// Whether `size` is one of T's released sizes or at least this header's.
template <typename T>
constexpr bool accepted_struct_size(std::size_t size) {
  static_assert(well_formed_sizes<T>());
  if (size >= StructSizes<T>::kCurrent) return true;
  for (const std::size_t s : StructSizes<T>::kAccepted) {
    if (s == size) return true;
  }
  return false;
}

}  // namespace strata::abi
