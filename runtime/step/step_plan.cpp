// The step plan as a whole: the profile checked, each decision the profile carries what it needs
// for made in order (residency, the loss chunk, checkpoint homes, kept activations), and the
// dumps.
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

Status check(const StepProfile& p) {
  if (p.blocks.size() > kMaxBlocks) {
    return error(Code::kInvalidArgument, "step profile: ", p.blocks.size(), " blocks; at most ",
                 kMaxBlocks);
  }
  // With no blocks only the step's own figures are planned (the host budget, the loss chunk,
  // the margin): checkpoints and kept activations are the blocks'.
  if (p.blocks.empty() && (p.tokens != 0 || p.step_measured)) {
    return error(Code::kInvalidArgument,
                 "step profile: ", p.tokens != 0 ? "tokens" : "a measured step",
                 " given with no blocks (checkpoint homes and kept activations are the blocks')");
  }
  bool choose = false, fixed = false, streamed_seen = false;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const auto& b = p.blocks[i];
    for (auto [v, name] : {std::pair{b.elements, "elements"},
                           {b.rank_elements, "rank_elements"},
                           {b.keep_whole_bytes, "keep_whole_bytes"},
                           {b.keep_selective_bytes, "keep_selective_bytes"}}) {
      if (v > kMaxBytes) {
        return error(Code::kInvalidArgument, "step profile: block ", i, "'s ", name, " is ", v,
                     ", above 2^56");
      }
    }
    if (b.rank_elements > b.elements) {
      return error(Code::kInvalidArgument, "step profile: block ", i, "'s rank_elements ",
                   b.rank_elements, " is more than its elements ", b.elements);
    }
    switch (b.residency) {
      case Residency::kChoose:
        choose = true;
        break;
      case Residency::kResident:
        if (streamed_seen) {
          return error(Code::kInvalidArgument, "step profile: block ", i,
                       " is resident after a streamed block; resident blocks are the first ones");
        }
        fixed = true;
        break;
      case Residency::kStreamed:
        streamed_seen = fixed = true;
        break;
      default:
        return error(Code::kInvalidArgument, "step profile: block ", i, "'s residency ",
                     static_cast<int32_t>(b.residency), " is not CHOOSE, RESIDENT or STREAMED");
    }
    if (b.keep != Keep::kRecompute && b.keep != Keep::kSelective && b.keep != Keep::kWhole) {
      return error(Code::kInvalidArgument, "step profile: block ", i, "'s keep ",
                   static_cast<int32_t>(b.keep), " is not RECOMPUTE, SELECTIVE or WHOLE");
    }
  }
  if (choose && fixed) {
    return error(Code::kInvalidArgument,
                 "step profile: some blocks' residency is CHOOSE and others' fixed; choose all "
                 "of them or none");
  }
  for (auto [v, name] : {std::pair{p.device_total, "device_total"},
                         {p.device_free, "device_free"},
                         {p.framework_held, "framework_held"},
                         {p.hbm_tier_bytes, "hbm_tier_bytes"},
                         {p.outside_elements, "outside_elements"},
                         {p.resident_bytes_per_param, "resident_bytes_per_param"},
                         {p.streamed_grad_bytes_per_param, "streamed_grad_bytes_per_param"},
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
                         {p.step_allocated_peak, "step_allocated_peak"},
                         {p.step_reserved_peak, "step_reserved_peak"},
                         {p.host_budget, "host_budget"},
                         {p.arena_bytes, "arena_bytes"},
                         {p.host_available, "host_available"},
                         {p.beside_bytes, "beside_bytes"}}) {
    STRATA_RETURN_IF_ERROR(check_bytes(v, name));
  }
  if (p.resident_bytes_per_param > 64 || p.streamed_grad_bytes_per_param > 8) {
    return error(Code::kInvalidArgument, "step profile: resident_bytes_per_param ",
                 p.resident_bytes_per_param, " (at most 64) or streamed_grad_bytes_per_param ",
                 p.streamed_grad_bytes_per_param, " (at most 8) is not a per-parameter size");
  }
  if (p.device_free > p.device_total) {
    return error(Code::kInvalidArgument, "step profile: device_free ", p.device_free,
                 " is more than device_total ", p.device_total);
  }
  if (p.tokens != 0 && p.device_total == 0) {
    return error(Code::kInvalidArgument,
                 "step profile: tokens given with no device (device_total 0): checkpoint homes "
                 "are planned against the device's memory");
  }
  for (std::size_t i = 0; i < p.intervals.size(); ++i) {
    const auto& point = p.intervals[i];
    if (point.kind != PointKind::kForward && point.kind != PointKind::kBackward &&
        point.kind != PointKind::kEnd) {
      return error(Code::kInvalidArgument, "step profile: interval ", i, "'s kind ",
                   static_cast<int32_t>(point.kind), " is not FORWARD, BACKWARD or END");
    }
    if (point.kind != PointKind::kEnd && point.block >= p.blocks.size()) {
      return error(Code::kInvalidArgument, "step profile: interval ", i, "'s block ", point.block,
                   " is not one of the ", p.blocks.size(), " blocks");
    }
  }
  if (!p.intervals.empty() && !p.step_measured) {
    return error(Code::kInvalidArgument,
                 "step profile: intervals given without a measured step (step_measured 0)");
  }
  return Status::ok();
}

}  // namespace

Status plan_step(const StepProfile& p, StepPlan* out) {
  STRATA_RETURN_IF_ERROR(check(p));
  StepPlan plan;
  plan.blocks.resize(p.blocks.size());
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    plan.blocks[i].residency =
        p.blocks[i].residency == Residency::kResident ? Residency::kResident : Residency::kStreamed;
    plan.blocks[i].keep = p.blocks[i].keep;
  }
  if (!p.blocks.empty() && p.blocks.front().residency == Residency::kChoose) {
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
  if (p.vocab != 0) {
    std::ostringstream o;
    o << std::fixed << std::setprecision(2);
    o << "loss: " << plan.loss_chunk_tokens << " tokens a chunk"
      << (p.loss_chunk_tokens ? " (given)" : "") << ", "
      << 4 * plan.loss_chunk_tokens * p.vocab / 1e9 << " GB of fp32 logits at a vocabulary of "
      << p.vocab << (p.loss_chunked ? "" : "; this model's loss runs whole, not over chunks");
    plan.reasons.push_back(o.str());
  }
  if (p.tokens != 0) plan_checkpoints(p, &plan);
  if (p.step_measured) plan_kept(p, &plan);
  plan.margin_bytes = margin_bytes(p);
  if (p.host_budget != 0 || p.arena_bytes != 0 || p.host_available != 0) {
    plan.host_total_bytes = host_total(p);
    std::ostringstream o;
    o << std::fixed << std::setprecision(2);
    o << "host: a budget of " << plan.host_total_bytes / 1e9 << " GB ("
      << (p.host_budget ? "given" : "default") << "): the DRAM arena " << p.arena_bytes / 1e9
      << " GB, " << p.beside_bytes / 1e9 << " GB held beside it, the rest for paged state and "
      << "spilled checkpoints"
      << (p.host_budget ? "" : " (half of this process's share of the host's available memory)");
    plan.reasons.push_back(o.str());
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

}  // namespace

std::string dump_text(const StepProfile& p, const StepPlan& plan) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "step plan: " << plan.blocks.size() << " blocks, " << plan.resident_blocks << " resident, "
    << plan.spilled_checkpoints << " checkpoints to host memory, " << plan.kept_blocks
    << " keeping activations";
  if (plan.loss_chunk_tokens) o << ", loss chunk " << plan.loss_chunk_tokens << " tokens";
  if (plan.checkpoints_planned && !plan.fits) o << " (PREDICTED SHORT of device memory)";
  o << "\n";
  for (const auto& why : plan.reasons) o << "  " << why << "\n";
  o << "  block  residency  activations  checkpoint\n";
  for (std::size_t i = 0; i < plan.blocks.size(); ++i) {
    const auto& b = plan.blocks[i];
    o << "  " << std::setw(5) << i << "  " << std::setw(9) << residency_name(b.residency) << "  "
      << std::setw(11) << keep_name(b.keep) << "  " << home_name(b.checkpoint) << "\n";
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
      {"fits", plan.fits},
      {"backward_reserve_bytes", plan.backward_reserve_bytes},
      {"keep_planned", plan.keep_planned},
      {"kept_blocks", plan.kept_blocks},
      {"judged_peak_bytes", plan.judged_peak},
      {"usable_bytes", plan.usable_bytes},
      {"margin_bytes", plan.margin_bytes},
      {"host_total_bytes", plan.host_total_bytes},
      {"loss_chunk_tokens", plan.loss_chunk_tokens},
      {"tokens", p.tokens},
      {"reasons", plan.reasons},
  };
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& b : plan.blocks) {
    blocks.push_back({{"residency", residency_name(b.residency)},
                      {"activations", keep_name(b.keep)},
                      {"checkpoint", home_name(b.checkpoint)}});
  }
  root["blocks"] = std::move(blocks);
  // Diagnostics may hold any bytes a caller named: invalid UTF-8 is replaced, never thrown.
  return root.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace strata::step
