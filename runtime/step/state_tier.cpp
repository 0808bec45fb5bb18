// The optimizer state's tier, as the step needs it: where the host's room cannot hold the
// spilled checkpoints one checkpoint per block needs (an 8B Llama at 148 x 1024 tokens on a
// 128 GiB host: 13 of 24), the streamed blocks' optimizer state in DRAM (12 bytes a parameter
// beside the weights, ~90 GB for an 8B) is what host memory holds most of, and an NVMe tier
// can hold it instead (the placement streams it from there, strata_placement_*). Moving it
// frees host memory for checkpoints; grouping checkpoints costs a forward pass of every grouped
// block past a group's first. The plan prefers the move, and says why where it cannot.
//
// The state lives where the binding placed it when it made its DRAM tier, before any batch was
// known; the checkpoints' room is what the budget leaves beside it. So this decision is advice
// to the binding's placement, not a change to this plan's checkpoint homes: the binding moves
// state_nvme_bytes of state (its next placement) and plans again with the room it freed.
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

void plan_state_tier(const StepProfile& p, const StepFigures& f, const Grouping& chosen,
                     StepPlan* plan) {
  plan->state_group_blocks = chosen.k;
  std::ostringstream o;
  o << std::fixed << std::setprecision(2) << "optimizer state: ";
  const auto decide = [&](StateReason reason, uint64_t bytes, uint32_t group) {
    plan->state_reason = reason;
    plan->state_nvme_bytes = bytes;
    plan->state_group_blocks = group;
    plan->reasons.push_back(o.str());
  };
  // What the step would take of the host with room for every checkpoint it wants spilled.
  const Grouping unbounded = choose_grouping(p, *plan, f, UINT64_MAX);
  if (!unbounded.spills.fits) {
    o << "stays where it is: the device is short even with every checkpoint in host memory "
         "(host memory is not what the step lacks)";
    return decide(StateReason::kDeviceShort, 0, chosen.k);
  }
  const uint64_t wanted = unbounded.spills.bytes;
  if ((chosen.spills.fits && chosen.k <= unbounded.k) || wanted <= p.host_room) {
    o << "stays where it is: the host's room for checkpoints ("
      << (p.host_room == UINT64_MAX ? std::string("unbounded") : size_text(p.host_room))
      << ") holds the " << size_text(wanted) << " the step spills";
    return decide(StateReason::kRoom, 0, chosen.k);
  }
  const uint64_t need = wanted - p.host_room;
  o << "the step wants " << size_text(wanted) << " of checkpoints in host memory"
    << (unbounded.k > 1 ? " (one per group of " + std::to_string(unbounded.k) + ")" : "")
    << ", its room holds " << size_text(p.host_room) << ": ";
  if (p.nvme_free == 0) {
    o << "no NVMe tier (or no room left on it) for the streamed blocks' optimizer state, so "
         "checkpoints "
      << (chosen.k > 1 ? "are grouped" : "stay on the device") << " instead";
    return decide(StateReason::kNoNvme, 0, chosen.k);
  }
  if (p.state_dram == 0) {
    o << "no optimizer state in DRAM to move to NVMe";
    return decide(StateReason::kNoState, 0, chosen.k);
  }
  const uint64_t movable = std::min(p.state_dram, p.nvme_free);
  if (movable >= need) {
    o << size_text(need) << " of the streamed blocks' optimizer state to NVMe (of "
      << size_text(p.state_dram) << " in DRAM, NVMe free " << size_text(p.nvme_free)
      << ") gives them that room: "
      << (unbounded.k > 1 ? "groups of " + std::to_string(unbounded.k)
                          : std::string("one checkpoint per block"))
      << " instead of " << (chosen.k > 1 ? "groups of " + std::to_string(chosen.k) : "one each")
      << (chosen.spills.fits ? "" : " short of memory")
      << "; the binding moves it and plans again (this plan's checkpoints are for the room as "
         "given)";
    return decide(StateReason::kMove, need, unbounded.k);
  }
  // All it can move, where that still lowers the group (or makes the step fit).
  const Grouping partial = choose_grouping(p, *plan, f, sat_add(p.host_room, movable));
  const bool better = partial.spills.fits && (!chosen.spills.fits || partial.k < chosen.k);
  if (better && partial.spills.bytes > p.host_room) {
    const uint64_t bytes = partial.spills.bytes - p.host_room;
    o << size_text(bytes)
      << " of the streamed blocks' optimizer state to NVMe (all it can take: " << size_text(movable)
      << ") gives groups of " << partial.k << " instead of "
      << (chosen.k > 1 ? "groups of " + std::to_string(chosen.k) : "one each")
      << (chosen.spills.fits ? "" : " short of memory") << "; the binding moves it and plans again";
    return decide(StateReason::kMove, bytes, partial.k);
  }
  o << "stays where it is: the " << size_text(movable)
    << " of it NVMe could take would not lower the checkpoint group (" << chosen.k << ")";
  decide(StateReason::kTooLittle, 0, chosen.k);
}

}  // namespace strata::step
