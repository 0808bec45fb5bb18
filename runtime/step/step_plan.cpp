// The step plan as a whole: the profile checked, each decision the profile carries what it needs
// for made in order (residency, the loss chunk, kept activations, checkpoint homes with the MLP's
// sequence tiles and the optimizer state's tier; transfers against compute before kept
// activations), and the dumps.
#include "runtime/step/step_plan.h"

#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

namespace strata::step {
namespace {

constexpr uint64_t kMaxBytes = uint64_t{1} << 56;  // 64 PiB: beyond it a figure is a mistake
constexpr std::size_t kMaxBlocks = 16384;

Status check_bytes(uint64_t value, const char* field) {
  if (value > kMaxBytes) {
    return error(Code::kInvalidArgument, "step profile: ", field, " is ", value,
                 ", above 2^56 (a size in bytes or elements)");
  }
  return Status::ok();
}

Status invalid(const auto&... parts) {
  return error(Code::kInvalidArgument, "step profile: ", parts...);
}

Status check_blocks(const StepProfile& p, bool* choose) {
  bool fixed = false, streamed_seen = false;
  *choose = false;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const auto& b = p.blocks[i];
    for (auto [v, name] : {std::pair{b.elements, "elements"},
                           {b.rank_elements, "rank_elements"},
                           {b.keep_whole_bytes, "keep_whole_bytes"},
                           {b.keep_selective_bytes, "keep_selective_bytes"},
                           {b.active_flops, "active_flops"}}) {
      if (v > kMaxBytes) return invalid("block ", i, "'s ", name, " is ", v, ", above 2^56");
    }
    if (b.rank_elements > b.elements) {
      return invalid("block ", i, "'s rank_elements ", b.rank_elements,
                     " is more than its elements ", b.elements);
    }
    switch (b.residency) {
      case Residency::kChoose:
        *choose = true;
        break;
      case Residency::kResident:
        if (streamed_seen) {
          return invalid("block ", i,
                         " is resident after a streamed block; resident blocks are the first ones");
        }
        fixed = true;
        break;
      case Residency::kStreamed:
        streamed_seen = fixed = true;
        break;
      default:
        return invalid("block ", i, "'s residency ", static_cast<int32_t>(b.residency),
                       " is not CHOOSE, RESIDENT or STREAMED");
    }
    if (b.keep != Keep::kRecompute && b.keep != Keep::kSelective && b.keep != Keep::kWhole) {
      return invalid("block ", i, "'s keep ", static_cast<int32_t>(b.keep),
                     " is not RECOMPUTE, SELECTIVE or WHOLE");
    }
    if (b.keep == Keep::kWhole && b.residency == Residency::kStreamed) {
      return invalid("block ", i,
                     " is streamed and kept WHOLE; a streamed block keeps at most "
                     "SELECTIVE (wholly would keep its weights)");
    }
    if (p.plan_kept && b.keep != Keep::kRecompute) {
      return invalid("block ", i,
                     "'s keep is not RECOMPUTE with STRATA_STEP_PLAN_KEPT: a "
                     "measured step is one in which every block recomputed (its "
                     "peaks are what the plan adds kept bytes to)");
    }
  }
  if (*choose && fixed) {
    return invalid(
        "some blocks' residency is CHOOSE and others' fixed; choose all of them or none");
  }
  return Status::ok();
}

Status check_figures(const StepProfile& p) {
  for (auto [v, name] : {std::pair{p.device_total, "device_total"},
                         {p.device_free, "device_free"},
                         {p.framework_held, "framework_held"},
                         {p.hbm_tier_bytes, "hbm_tier_bytes"},
                         {p.outside_elements, "outside_elements"},
                         {p.streamed_grads_hbm_bytes, "streamed_grads_hbm_bytes"},
                         {p.tokens, "tokens"},
                         {p.checkpoint_bytes, "checkpoint_bytes"},
                         {p.block_saved_bytes, "block_saved_bytes"},
                         {p.in_use, "in_use"},
                         {p.backward_grad_bytes, "backward_grad_bytes"},
                         {p.leaving_bytes, "leaving_bytes"},
                         {p.vocab, "vocab"},
                         {p.hidden, "hidden"},
                         {p.loss_chunk_tokens, "loss_chunk_tokens"},
                         {p.loss_working_bytes, "loss_working_bytes"},
                         {p.step_allocated_peak, "step_allocated_peak"},
                         {p.step_reserved_peak, "step_reserved_peak"},
                         {p.host_budget, "host_budget"},
                         {p.arena_bytes, "arena_bytes"},
                         {p.host_available, "host_available"},
                         {p.beside_bytes, "beside_bytes"},
                         {p.mlp_token_bytes, "mlp_token_bytes"},
                         {p.state_dram, "state_dram_bytes"},
                         {p.nvme_free, "nvme_free_bytes"}}) {
    STRATA_RETURN_IF_ERROR(check_bytes(v, name));
  }
  if (p.max_group > kMaxBlocks || p.given_group > kMaxBlocks) {
    return invalid("max_group_blocks ", p.max_group, " or checkpoint_group_blocks ", p.given_group,
                   " is more than ", kMaxBlocks, " blocks");
  }
  if (p.mlp_token_bytes != 0 &&
      (!p.block_saved_measured || sat_mul(p.mlp_token_bytes, p.tokens) > p.block_saved_bytes)) {
    return invalid("mlp_token_bytes ", p.mlp_token_bytes, " x tokens ", p.tokens,
                   " is more than block_saved_bytes ", p.block_saved_bytes,
                   " or that was not measured (STRATA_STEP_BLOCK_SAVED_MEASURED): the MLP's "
                   "bytes are a part of the block's");
  }
  if (p.given_tiles != 0 && (!p.plan_checkpoints || p.given_tiles > p.tokens)) {
    return invalid("mlp_tiles ", p.given_tiles,
                   " needs STRATA_STEP_PLAN_CHECKPOINTS and at most the batch's tokens (", p.tokens,
                   ")");
  }
  for (auto [v, name] : {std::pair{p.h2d_bytes_per_second, "h2d_bytes_per_second"},
                         {p.device_flops_per_second, "device_flops_per_second"}}) {
    if (!(v >= 0) || v > 1e18) {  // (NaN fails the first)
      return invalid(name, " is ", v, ", not a rate from 0 (unknown) to 1e18 a second");
    }
  }
  if (p.weight_bytes_per_param > 64) {
    return invalid("weight_bytes_per_param ", p.weight_bytes_per_param,
                   " is above 64 (the bytes a streamed weight moves a parameter)");
  }
  if (p.device_free > p.device_total || p.framework_held > p.device_total) {
    return invalid("device_free ", p.device_free, " or framework_held ", p.framework_held,
                   " is more than device_total ", p.device_total);
  }
  return Status::ok();
}

Status check_residency(const StepProfile& p) {
  if (p.resident_bytes_per_param == 0 || p.resident_bytes_per_param > 64) {
    return invalid("resident_bytes_per_param ", p.resident_bytes_per_param,
                   " is not 1..64 while choosing residency (the bytes a resident parameter "
                   "takes on the device)");
  }
  if (p.streamed_grad_bytes_per_param > p.resident_bytes_per_param) {
    return invalid("streamed_grad_bytes_per_param ", p.streamed_grad_bytes_per_param,
                   " is more than resident_bytes_per_param ", p.resident_bytes_per_param);
  }
  if ((p.streamed_grad_bytes_per_param == 0) != (p.streamed_grads_hbm_bytes == 0)) {
    return invalid("streamed_grad_bytes_per_param ", p.streamed_grad_bytes_per_param,
                   " and streamed_grads_hbm_bytes ", p.streamed_grads_hbm_bytes,
                   " disagree: both 0 (grads in DRAM) or both set (grads in HBM)");
  }
  return Status::ok();
}

Status check_decisions(const StepProfile& p) {
  if (p.plan_checkpoints) {
    if (p.device_total == 0 || p.blocks.empty() || p.tokens == 0 || p.checkpoint_bytes == 0) {
      return invalid("STRATA_STEP_PLAN_CHECKPOINTS needs a device (device_total ", p.device_total,
                     "), blocks (", p.blocks.size(), "), tokens (", p.tokens,
                     ") and checkpoint_bytes (", p.checkpoint_bytes, ")");
    }
  }
  if (p.plan_kept && (p.device_total == 0 || p.blocks.empty())) {
    return invalid("STRATA_STEP_PLAN_KEPT needs a device (device_total ", p.device_total,
                   ") and blocks (", p.blocks.size(), ")");
  }
  if (!p.intervals.empty() && !p.plan_kept) {
    return invalid("intervals given without STRATA_STEP_PLAN_KEPT");
  }
  if (p.step_reserved_peak < p.step_allocated_peak) {
    return invalid("step_reserved_peak ", p.step_reserved_peak, " is below step_allocated_peak ",
                   p.step_allocated_peak,
                   " (pass allocated for both where the allocator has one "
                   "figure)");
  }
  for (std::size_t i = 0; i < p.intervals.size(); ++i) {
    const auto& point = p.intervals[i];
    if (point.kind != PointKind::kForward && point.kind != PointKind::kBackward &&
        point.kind != PointKind::kEnd) {
      return invalid("interval ", i, "'s kind ", static_cast<int32_t>(point.kind),
                     " is not FORWARD, BACKWARD or END");
    }
    if (point.kind != PointKind::kEnd && point.block >= p.blocks.size()) {
      return invalid("interval ", i, "'s block ", point.block, " is not one of the ",
                     p.blocks.size(), " blocks");
    }
    if (point.kind == PointKind::kEnd && point.block != 0) {
      return invalid("interval ", i, " is the step's END with block ", point.block, ", not 0");
    }
    if (point.reserved_peak < point.allocated_peak || point.reserved_peak > p.step_reserved_peak ||
        point.allocated_peak > p.step_allocated_peak) {
      return invalid("interval ", i, "'s peaks (allocated ", point.allocated_peak, ", reserved ",
                     point.reserved_peak, ") are not reserved >= allocated within the step's (",
                     p.step_allocated_peak, ", ", p.step_reserved_peak, ")");
    }
  }
  return Status::ok();
}

Status check(const StepProfile& p, bool* choose) {
  if (p.blocks.size() > kMaxBlocks) {
    return invalid(p.blocks.size(), " blocks; at most ", kMaxBlocks);
  }
  STRATA_RETURN_IF_ERROR(check_blocks(p, choose));
  STRATA_RETURN_IF_ERROR(check_figures(p));
  if (*choose) STRATA_RETURN_IF_ERROR(check_residency(p));
  return check_decisions(p);
}

std::string loss_reason(const StepProfile& p, uint64_t chunk) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "loss: " << chunk << " tokens a chunk" << (p.loss_chunk_tokens ? " (given)" : "") << ", "
    << size_text(sat_mul(sat_mul(4, chunk), p.vocab)) << " of fp32 logits at a vocabulary of "
    << p.vocab << (p.loss_chunked ? "" : "; this model's loss runs whole, not over chunks");
  return o.str();
}

std::string host_reason(const StepProfile& p, uint64_t total) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "host: a budget of " << size_text(total) << " (" << (p.host_budget ? "given" : "default")
    << "): the DRAM arena " << size_text(p.arena_bytes) << ", " << size_text(p.beside_bytes)
    << " held beside it, the rest for paged state and spilled checkpoints"
    << (p.host_budget      ? ""
        : p.host_available ? " (half of what the held bytes leave of this process's share of "
                             "the host's available memory)"
                           : " (no available memory given: the arena and the held bytes only)");
  return o.str();
}

}  // namespace

// Residency first (the others count the resident blocks), then kept activations, then the
// checkpoint homes counted with what the kept blocks hold.
std::string size_text(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes) / 1024;
  std::size_t unit = 0;
  while (value >= 1024 && unit + 1 < std::size(kUnits)) {
    value /= 1024;
    ++unit;
  }
  std::ostringstream o;
  o << std::fixed << std::setprecision(unit >= 2 ? 2 : 1) << value << ' ' << kUnits[unit];
  return o.str();
}

Status plan_step(const StepProfile& p, StepPlan* out) {
  bool choose = false;
  STRATA_RETURN_IF_ERROR(check(p, &choose));
  StepPlan plan;
  plan.blocks.resize(p.blocks.size());
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    plan.blocks[i].residency =
        p.blocks[i].residency == Residency::kResident ? Residency::kResident : Residency::kStreamed;
    plan.blocks[i].keep = p.blocks[i].keep;
    plan.blocks[i].group_start = static_cast<uint32_t>(i);
  }
  if (choose) {
    std::string why;
    plan.resident_blocks = choose_resident(p, &why);
    for (uint32_t i = 0; i < plan.resident_blocks; ++i) {
      plan.blocks[i].residency = Residency::kResident;
    }
    plan.residency_planned = true;
    plan.reasons.push_back(why);
  } else {
    for (const auto& b : plan.blocks) plan.resident_blocks += b.residency == Residency::kResident;
  }
  plan.loss_chunk_tokens = p.loss_chunk_tokens ? p.loss_chunk_tokens : default_loss_chunk(p.vocab);
  if (p.vocab != 0) plan.reasons.push_back(loss_reason(p, plan.loss_chunk_tokens));
  if (p.device_total != 0) {
    plan.usable_bytes = sat_add(p.device_free, p.framework_held);
    plan.margin_bytes = margin_bytes(p);
  }
  judge_transfers(p, &plan);
  if (p.plan_kept) plan_kept(p, &plan);
  if (p.plan_checkpoints) plan_checkpoints(p, &plan);
  for (const auto& b : plan.blocks) {
    plan.kept_blocks += b.keep != Keep::kRecompute;
    plan.whole_blocks += b.keep == Keep::kWhole;
  }
  if (p.host_budget != 0 || p.arena_bytes != 0 || p.host_available != 0) {
    plan.host_total_bytes = host_total(p);
    plan.reasons.push_back(host_reason(p, plan.host_total_bytes));
  }
  *out = std::move(plan);
  return Status::ok();
}

namespace {

const char* residency_name(Residency r) {
  return r == Residency::kResident ? "resident" : "streamed";
}
const char* keep_name(Keep k) {
  return k == Keep::kWhole ? "whole" : k == Keep::kSelective ? "selective" : "recompute";
}
const char* home_name(CheckpointHome h) {
  return h == CheckpointHome::kDram ? "dram" : "hbm";
}
const char* state_reason_name(StateReason r) {
  switch (r) {
    case StateReason::kRoom:
      return "room";
    case StateReason::kMove:
      return "move";
    case StateReason::kDeviceShort:
      return "device_short";
    case StateReason::kNoNvme:
      return "no_nvme";
    case StateReason::kNoState:
      return "no_state";
    case StateReason::kTooLittle:
      return "too_little";
    case StateReason::kNotPlanned:
      break;
  }
  return "not_planned";
}

}  // namespace

std::string dump_text(const StepProfile& p, const StepPlan& plan) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "step plan: " << plan.blocks.size() << " blocks, " << plan.resident_blocks << " resident, "
    << plan.spilled_checkpoints << " checkpoints to host memory";
  if (plan.group_blocks > 1) o << " (one per group of " << plan.group_blocks << " blocks)";
  o << ", " << plan.kept_blocks << " keeping activations";
  if (plan.loss_chunk_tokens) o << ", loss chunk " << plan.loss_chunk_tokens << " tokens";
  if (plan.mlp_tiles > 1) {
    o << ", MLP over " << plan.mlp_tiles << " tiles of " << plan.mlp_tile_tokens << " tokens";
  }
  if (plan.state_nvme_bytes) {
    o << ", advised: " << size_text(plan.state_nvme_bytes) << " of optimizer state to NVMe";
  }
  if (plan.checkpoints_planned && !plan.fits) o << " (PREDICTED SHORT of device memory)";
  o << "\n";
  for (const auto& why : plan.reasons) o << "  " << why << "\n";
  o << "  block  residency  activations  mlp tiles  checkpoint"
    << (plan.transfers_judged ? "  (transfer-bound)" : "") << "\n";
  const auto checkpoint_text = [&](std::size_t i) {
    const auto& b = plan.blocks[i];
    return b.group_start == i ? std::string(home_name(b.checkpoint))
                              : "from block " + std::to_string(b.group_start);
  };
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    o << "  " << std::setw(5) << i << "  " << std::setw(9) << residency_name(b.residency) << "  "
      << std::setw(11) << keep_name(b.keep) << "  " << std::setw(9) << b.mlp_tiles << "  "
      << checkpoint_text(i) << (b.transfer_bound ? "  transfer-bound" : "") << "\n";
  }
  (void)p;  // (the profile's figures are in the reasons)
  return o.str();
}

std::string dump_json(const StepProfile& p, const StepPlan& plan) {
  nlohmann::json root = {
      {"blocks_total", plan.blocks.size()},
      {"resident_blocks", plan.resident_blocks},
      {"residency_planned", plan.residency_planned},
      {"checkpoints_planned", plan.checkpoints_planned},
      {"spilled_checkpoints", plan.spilled_checkpoints},
      {"spilled_bytes", plan.spilled_bytes},
      {"checkpoint_group_blocks", plan.group_blocks},
      {"fits", plan.fits},
      {"backward_reserve_bytes", plan.backward_reserve_bytes},
      {"keep_planned", plan.keep_planned},
      {"kept_blocks", plan.kept_blocks},
      {"whole_blocks", plan.whole_blocks},
      {"predicted_peak_bytes", plan.predicted_peak},
      {"judged_peak_bytes", plan.judged_peak},
      {"usable_bytes", plan.usable_bytes},
      {"margin_bytes", plan.margin_bytes},
      {"host_total_bytes", plan.host_total_bytes},
      {"loss_chunk_tokens", plan.loss_chunk_tokens},
      {"tokens", p.tokens},
      {"mlp_tiles", plan.mlp_tiles},
      {"mlp_tile_tokens", plan.mlp_tile_tokens},
      {"state_nvme_bytes", plan.state_nvme_bytes},
      {"state_nvme_group_blocks", plan.state_group_blocks},
      {"state_tier_reason", state_reason_name(plan.state_reason)},
      {"transfers_judged", plan.transfers_judged},
      {"transfer_bound_blocks", plan.transfer_bound_blocks},
      {"reasons", plan.reasons},
  };
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& b : plan.blocks) {
    blocks.push_back({{"residency", residency_name(b.residency)},
                      {"activations", keep_name(b.keep)},
                      {"checkpoint", home_name(b.checkpoint)},
                      {"group_start", b.group_start},
                      {"mlp_tiles", b.mlp_tiles},
                      {"transfer_bound", b.transfer_bound}});
  }
  root["blocks"] = std::move(blocks);
  // Diagnostics may hold any bytes a caller named: invalid UTF-8 is replaced, never thrown.
  return root.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace strata::step
