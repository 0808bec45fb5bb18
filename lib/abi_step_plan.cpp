// C ABI: the step-memory plan (runtime/step/): a binding's profile in, per-block choices out.
#include <algorithm>

#include "lib/abi_support.h"
#include "runtime/step/step_plan.h"

using namespace strata;
using namespace strata::abi;

static_assert(STRATA_TIER_HBM == static_cast<int>(step::CheckpointHome::kHbm) &&
              STRATA_TIER_DRAM == static_cast<int>(step::CheckpointHome::kDram));
static_assert(STRATA_RESIDENCY_CHOOSE == static_cast<int>(step::Residency::kChoose) &&
              STRATA_RESIDENCY_RESIDENT == static_cast<int>(step::Residency::kResident) &&
              STRATA_RESIDENCY_STREAMED == static_cast<int>(step::Residency::kStreamed));
static_assert(STRATA_KEEP_RECOMPUTE == static_cast<int>(step::Keep::kRecompute) &&
              STRATA_KEEP_SELECTIVE == static_cast<int>(step::Keep::kSelective) &&
              STRATA_KEEP_WHOLE == static_cast<int>(step::Keep::kWhole));
static_assert(STRATA_STEP_STATE_NOT_PLANNED == static_cast<int>(step::StateReason::kNotPlanned) &&
              STRATA_STEP_STATE_ROOM == static_cast<int>(step::StateReason::kRoom) &&
              STRATA_STEP_STATE_MOVE == static_cast<int>(step::StateReason::kMove) &&
              STRATA_STEP_STATE_DEVICE_SHORT == static_cast<int>(step::StateReason::kDeviceShort) &&
              STRATA_STEP_STATE_NO_NVME == static_cast<int>(step::StateReason::kNoNvme) &&
              STRATA_STEP_STATE_NO_STATE == static_cast<int>(step::StateReason::kNoState) &&
              STRATA_STEP_STATE_TOO_LITTLE == static_cast<int>(step::StateReason::kTooLittle));
static_assert(STRATA_STEP_POINT_FORWARD == static_cast<int>(step::PointKind::kForward) &&
              STRATA_STEP_POINT_BACKWARD == static_cast<int>(step::PointKind::kBackward) &&
              STRATA_STEP_POINT_END == static_cast<int>(step::PointKind::kEnd));

struct strata_step_plan {
  step::StepProfile profile;  // the blocks' measured figures, given back by get_block
  step::StepPlan plan;
};

namespace {

constexpr uint32_t kMaxBlocks = 16384;
constexpr uint32_t kMaxIntervals = 4 * kMaxBlocks + 4;

Status read_profile(const strata_step_profile_t* user, step::StepProfile* out) {
  strata_step_profile_t q{};
  (void)strata_step_profile_init(&q);
  STRATA_RETURN_IF_ERROR(read_struct(user, &q));
  if (q.block_count > kMaxBlocks) {  // before reading any of them
    return error(Code::kInvalidArgument, "the step profile has ", q.block_count,
                 " blocks; at most ", kMaxBlocks);
  }
  if (q.block_count > 0 && q.blocks == nullptr) {
    return error(Code::kInvalidArgument, "blocks is NULL with a block_count of ", q.block_count);
  }
  if (q.interval_count > kMaxIntervals) {
    return error(Code::kInvalidArgument, "the step profile has ", q.interval_count,
                 " intervals; at most ", kMaxIntervals);
  }
  if (q.interval_count > 0 && q.intervals == nullptr) {
    return error(Code::kInvalidArgument, "intervals is NULL with an interval_count of ",
                 q.interval_count);
  }
  step::StepProfile p;
  for (uint32_t i = 0; i < q.block_count; ++i) {
    if (q.blocks[i] == nullptr) return error(Code::kInvalidArgument, "blocks[", i, "] is NULL");
    strata_step_block_t b{};
    (void)strata_step_block_init(&b);
    STRATA_RETURN_IF_ERROR(read_struct(q.blocks[i], &b));
    p.blocks.push_back({b.elements, b.rank_elements, b.keep_whole_bytes, b.keep_selective_bytes,
                        static_cast<step::Residency>(b.residency), static_cast<step::Keep>(b.keep),
                        b.active_flops});
  }
  for (uint32_t i = 0; i < q.interval_count; ++i) {
    if (q.intervals[i] == nullptr) {
      return error(Code::kInvalidArgument, "intervals[", i, "] is NULL");
    }
    strata_step_interval_t t{};
    (void)strata_step_interval_init(&t);
    STRATA_RETURN_IF_ERROR(read_struct(q.intervals[i], &t));
    p.intervals.push_back({static_cast<step::PointKind>(t.point), t.block, t.allocated_peak_bytes,
                           t.reserved_peak_bytes});
  }
  constexpr uint32_t kKnownFlags = STRATA_STEP_PLAN_CHECKPOINTS | STRATA_STEP_PLAN_KEPT |
                                   STRATA_STEP_ALLOCATOR_RETURNS_CACHE |
                                   STRATA_STEP_BLOCK_SAVED_MEASURED | STRATA_STEP_LOSS_CHUNKED;
  if ((q.flags & ~kKnownFlags) != 0) {
    return error(Code::kInvalidArgument, "step profile: unknown flags 0x", std::hex,
                 q.flags & ~kKnownFlags, " (STRATA_STEP_* bits only)");
  }
  p.plan_checkpoints = (q.flags & STRATA_STEP_PLAN_CHECKPOINTS) != 0;
  p.plan_kept = (q.flags & STRATA_STEP_PLAN_KEPT) != 0;
  p.allocator_returns_cache = (q.flags & STRATA_STEP_ALLOCATOR_RETURNS_CACHE) != 0;
  p.block_saved_measured = (q.flags & STRATA_STEP_BLOCK_SAVED_MEASURED) != 0;
  p.loss_chunked = (q.flags & STRATA_STEP_LOSS_CHUNKED) != 0;
  p.ranks_on_host = q.ranks_on_host;
  p.resident_bytes_per_param = q.resident_bytes_per_param;
  p.streamed_grad_bytes_per_param = q.streamed_grad_bytes_per_param;
  p.device_total = q.device_total_bytes;
  p.device_free = q.device_free_bytes;
  p.framework_held = q.framework_held_bytes;
  p.hbm_tier_bytes = q.hbm_tier_bytes;
  p.outside_elements = q.outside_elements;
  p.streamed_grads_hbm_bytes = q.streamed_grads_hbm_bytes;
  p.tokens = q.tokens;
  p.checkpoint_bytes = q.checkpoint_bytes;
  p.block_saved_bytes = q.block_saved_bytes;
  p.in_use = q.in_use_bytes;
  p.backward_grad_bytes = q.backward_grad_bytes;
  p.leaving_bytes = q.leaving_bytes;
  p.vocab = q.vocab;
  p.hidden = q.hidden;
  p.loss_chunk_tokens = q.loss_chunk_tokens;
  p.loss_working_bytes = q.loss_working_bytes;
  p.step_allocated_peak = q.step_allocated_peak_bytes;
  p.step_reserved_peak = q.step_reserved_peak_bytes;
  p.host_budget = q.host_budget_bytes;
  p.arena_bytes = q.arena_bytes;
  p.host_available = q.host_available_bytes;
  p.beside_bytes = q.beside_bytes;
  p.host_room = q.host_room_bytes;
  p.max_group = std::max<uint32_t>(1, q.max_group_blocks);
  p.given_group = q.checkpoint_group_blocks;
  p.mlp_token_bytes = q.mlp_token_bytes;
  p.given_tiles = q.mlp_tiles;
  p.state_dram = q.state_dram_bytes;
  p.nvme_free = q.nvme_free_bytes;
  p.h2d_bytes_per_second = q.h2d_bytes_per_second;
  p.device_flops_per_second = q.device_flops_per_second;
  p.weight_bytes_per_param = q.weight_bytes_per_param;
  *out = std::move(p);
  return Status::ok();
}

}  // namespace

extern "C" {

STRATA_API strata_status_t strata_step_profile_init(strata_step_profile_t* profile) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(profile, "profile"));
    *profile = strata_step_profile_t{};
    profile->struct_size = STRATA_STEP_PROFILE_STRUCT_SIZE;
    profile->ranks_on_host = 1;  // (0 reads as 1 too)
    profile->host_room_bytes = UINT64_MAX;
    profile->max_group_blocks = 1;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_block_init(strata_step_block_t* block) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(block, "block"));
    *block = strata_step_block_t{};
    block->struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
    block->residency = STRATA_RESIDENCY_CHOOSE;
    block->keep = STRATA_KEEP_RECOMPUTE;
    block->checkpoint_tier = STRATA_TIER_HBM;
    block->mlp_tiles = 1;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_interval_init(strata_step_interval_t* interval) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(interval, "interval"));
    *interval = strata_step_interval_t{};
    interval->struct_size = STRATA_STEP_INTERVAL_STRUCT_SIZE;
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_plan_create(const strata_step_profile_t* profile,
                                                   strata_step_plan_t** out_plan) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(out_plan, "out_plan"));
    auto handle = std::make_unique<strata_step_plan>();
    STRATA_RETURN_IF_ERROR(read_profile(profile, &handle->profile));
    STRATA_RETURN_IF_ERROR(step::plan_step(handle->profile, &handle->plan));
    *out_plan = handle.release();
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_plan_destroy(strata_step_plan_t* plan) {
  delete plan;
  return STRATA_OK;
}

STRATA_API strata_status_t strata_step_plan_get_info(strata_step_plan_t* plan,
                                                     strata_step_plan_info_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    const step::StepPlan& p = plan->plan;
    strata_step_plan_info_t info{};
    info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
    info.blocks = static_cast<uint32_t>(p.blocks.size());
    info.resident_blocks = p.resident_blocks;
    info.spilled_checkpoints = p.spilled_checkpoints;
    info.kept_blocks = p.kept_blocks;
    info.whole_blocks = p.whole_blocks;
    info.restore_depth = step::kRestoreDepth;
    info.planned = (p.residency_planned ? STRATA_STEP_PLANNED_RESIDENCY : 0u) |
                   (p.checkpoints_planned ? STRATA_STEP_PLANNED_CHECKPOINTS : 0u) |
                   (p.keep_planned ? STRATA_STEP_PLANNED_KEPT : 0u);
    info.fits = p.fits ? 1 : 0;
    info.predicted_peak_bytes = p.predicted_peak;
    info.backward_reserve_bytes = p.backward_reserve_bytes;
    info.usable_bytes = p.usable_bytes;
    info.margin_bytes = p.margin_bytes;
    info.judged_peak_bytes = p.judged_peak;
    info.host_total_bytes = p.host_total_bytes;
    info.loss_chunk_tokens = p.loss_chunk_tokens;
    info.spilled_checkpoint_bytes = p.spilled_bytes;
    info.checkpoint_group_blocks = p.group_blocks;
    info.mlp_tiles = p.mlp_tiles;
    info.mlp_tile_tokens = p.mlp_tile_tokens;
    info.state_nvme_bytes = p.state_nvme_bytes;
    info.state_nvme_group_blocks = p.state_group_blocks;
    info.state_tier_reason = static_cast<uint32_t>(p.state_reason);
    info.transfer_bound_blocks = p.transfer_bound_blocks;
    write_struct(out, info);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_plan_get_block(strata_step_plan_t* plan, uint32_t index,
                                                      strata_step_block_t* out) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    STRATA_RETURN_IF_ERROR(check_out_struct(out));
    if (index >= plan->plan.blocks.size()) {
      return error(Code::kInvalidArgument, "block index ", index, " is not one of the plan's ",
                   plan->plan.blocks.size(), " blocks");
    }
    const step::BlockProfile& given = plan->profile.blocks[index];
    const step::BlockPlan& chosen = plan->plan.blocks[index];
    strata_step_block_t b{};
    b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
    b.elements = given.elements;
    b.rank_elements = given.rank_elements;
    b.keep_whole_bytes = given.keep_whole_bytes;
    b.keep_selective_bytes = given.keep_selective_bytes;
    b.residency = static_cast<strata_residency_t>(chosen.residency);
    b.keep = static_cast<strata_keep_t>(chosen.keep);
    b.checkpoint_tier = static_cast<strata_tier_t>(chosen.checkpoint);
    b.group_start = chosen.group_start;
    b.mlp_tiles = chosen.mlp_tiles;
    b.active_flops = given.active_flops;
    b.transfer_bound = chosen.transfer_bound ? 1 : 0;
    write_struct(out, b);
    return Status::ok();
  });
}

STRATA_API strata_status_t strata_step_plan_dump(strata_step_plan_t* plan,
                                                 strata_plan_format_t format, char* buffer,
                                                 size_t capacity, size_t* out_length) {
  return guarded(__func__, [&] {
    STRATA_RETURN_IF_ERROR(require(plan, "plan"));
    std::string text;
    if (format == STRATA_PLAN_FORMAT_JSON) {
      text = step::dump_json(plan->profile, plan->plan);
    } else if (format == STRATA_PLAN_FORMAT_TEXT) {
      text = step::dump_text(plan->profile, plan->plan);
    } else {
      return error(Code::kInvalidArgument, "unknown dump format ", format);
    }
    return copy_out_text(text, buffer, capacity, out_length);
  });
}

}  // extern "C"
