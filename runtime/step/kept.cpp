// Kept activations: which blocks skip their recompute, spending the device memory a measured
// step left unused. Selectively (only the outputs of matrix products and attention: two to
// three times as many blocks per byte for ~90% of the recompute each saves) first, then upgraded
// to whole with what is left.
#include <algorithm>
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

// Candidates from the first (the last resident block) on, stopping at the first that does not
// fit, each counted only in the intervals where its activations are alive; then, in the same
// order, selective ones upgraded to whole where the difference fits. Never keeps less than the
// same rule at the step's peak, since no interval's peak is more than it.
std::vector<Keep> choose_kept(uint64_t usable, uint64_t margin,
                              const std::vector<std::pair<uint64_t, uint64_t>>& candidates,
                              const std::vector<std::pair<int64_t, uint64_t>>& intervals,
                              const std::vector<int64_t>& order) {
  std::vector<uint64_t> extra(intervals.size(), 0);  // kept bytes alive in each interval
  const auto fits = [&](int64_t g, uint64_t cost) {
    for (std::size_t k = 0; k < intervals.size(); ++k) {
      if (g <= intervals[k].first &&
          !within(sat_add(sat_add(intervals[k].second, extra[k]), cost), usable, margin)) {
        return false;
      }
    }
    return true;
  };
  const auto add = [&](int64_t g, uint64_t cost) {
    for (std::size_t k = 0; k < intervals.size(); ++k) {
      if (g <= intervals[k].first) extra[k] = sat_add(extra[k], cost);
    }
  };
  std::vector<Keep> plan;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const auto [whole, selective] = candidates[i];
    Keep mode = Keep::kSelective;
    uint64_t cost = selective;
    if (whole == 0) {
      if (selective == 0) break;
    } else {
      if (selective == 0 || selective >= whole) mode = Keep::kWhole;
      cost = mode == Keep::kWhole ? whole : selective;
    }
    if (!fits(order[i], cost)) break;
    add(order[i], cost);
    plan.push_back(mode);
  }
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto [whole, selective] = candidates[i];
    if (plan[i] == Keep::kSelective && whole != 0 && fits(order[i], whole - selective)) {
      add(order[i], whole - selective);
      plan[i] = Keep::kWhole;
    }
  }
  return plan;
}

namespace {

// The last block (model order, of `count`) whose kept activations are alive in the interval that
// ends at `point`: before block i's forward start, block i-1's forward ran (blocks up to i-1
// made theirs); before the last block's backward start, its forward and the loss (all alive);
// before block i's backward start, block i+1's backward (it frees its own as it ends); at the
// end, block 0's backward and the step.
int64_t last_alive(const Interval& point, int64_t count) {
  switch (point.kind) {
    case PointKind::kForward:
      return static_cast<int64_t>(point.block) - 1;
    case PointKind::kBackward:
      return point.block == count - 1 ? count - 1 : point.block + 1;
    case PointKind::kEnd:
      break;
  }
  return 0;
}

// A measured peak as the plan counts it: what the allocator reserved (what fragmentation strands
// is as unusable as what is allocated: an H200 run planned from the allocated peak ran out of
// memory asking for 15.6 GiB of logits with 11 GiB reserved and unused), or with an allocator
// that gives its cache back, the allocated peak plus kFragmentationReturningCache of the device
// when that is less.
uint64_t judged(const StepProfile& p, uint64_t allocated, uint64_t reserved) {
  if (!p.allocator_returns_cache) return reserved;
  const uint64_t slack =
      static_cast<uint64_t>(static_cast<double>(p.device_total) * kFragmentationReturningCache);
  return std::min(reserved, sat_add(allocated, slack));
}

}  // namespace

// From the last resident block back while each was measured, then from the last streamed block
// back while each can keep selectively (wholly would keep its weights; its backward comes first,
// so what it holds is freed soonest), passing over the transfer-bound ones (transfers.cpp: their
// recompute runs while their weights load, so keeping saves no time and takes the memory
// another block's keeping would save time with). With every block's two points measured each kept
// block counts in the intervals where it is alive, else at the step's peak.
void plan_kept(const StepProfile& p, StepPlan* plan) {
  const int64_t count = static_cast<int64_t>(p.blocks.size());
  std::vector<std::pair<uint64_t, uint64_t>> candidates;
  std::vector<int64_t> order;
  int64_t residents = 0;
  while (residents < count && plan->blocks[residents].residency == Residency::kResident) {
    ++residents;
  }
  const auto factor = [](uint64_t b) {
    return static_cast<uint64_t>(static_cast<double>(b) * kBlockFactor);
  };
  for (int64_t i = residents - 1; i >= 0; --i) {
    if (p.blocks[i].keep_whole_bytes == 0) break;
    candidates.emplace_back(factor(p.blocks[i].keep_whole_bytes),
                            factor(p.blocks[i].keep_selective_bytes));
    order.push_back(i);
  }
  const std::size_t resident_candidates = candidates.size();
  uint32_t passed = 0;  // transfer-bound streamed blocks passed over
  for (int64_t i = count - 1; i >= residents; --i) {
    if (plan->blocks[i].transfer_bound) {
      ++passed;
      continue;
    }
    if (p.blocks[i].keep_selective_bytes == 0) break;
    candidates.emplace_back(0, factor(p.blocks[i].keep_selective_bytes));
    order.push_back(i);
  }
  std::vector<bool> seen(2 * count, false);
  std::vector<std::pair<int64_t, uint64_t>> intervals;
  for (const auto& point : p.intervals) {
    if (point.kind != PointKind::kEnd && point.block < count) {
      seen[2 * point.block + (point.kind == PointKind::kBackward ? 1 : 0)] = true;
    }
    intervals.emplace_back(last_alive(point, count),
                           judged(p, point.allocated_peak, point.reserved_peak));
  }
  const bool complete =
      !p.intervals.empty() && std::find(seen.begin(), seen.end(), false) == seen.end();
  const uint64_t peak = judged(p, p.step_allocated_peak, p.step_reserved_peak);
  const std::vector<int64_t> places = order;  // each candidate's block
  if (!complete) {  // one interval, the step's peak, where every kept block is alive
    intervals.assign(1, {0, peak});
    order.assign(order.size(), 0);
  }
  const uint64_t usable = sat_add(p.device_free, p.framework_held);
  const uint64_t margin = margin_bytes(p);
  const std::vector<Keep> modes = choose_kept(usable, margin, candidates, intervals, order);
  uint32_t whole = 0;
  for (auto& b : plan->blocks) b.keep = Keep::kRecompute;  // the profile's modes were the input
  for (std::size_t i = 0; i < modes.size(); ++i) {
    plan->blocks[places[i]].keep = modes[i];
    whole += modes[i] == Keep::kWhole ? 1 : 0;
  }
  plan->keep_planned = true;
  plan->judged_peak = peak;
  plan->usable_bytes = usable;
  plan->margin_bytes = margin;
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "activations: " << modes.size() << " blocks keep them (" << whole
    << " wholly, the rest only their products' and attention's outputs) of " << candidates.size()
    << " candidates (" << resident_candidates << " resident";
  if (passed != 0) o << "; " << passed << " transfer-bound streamed blocks passed over";
  o << "): the measured step peaked at " << size_text(peak) << " of " << size_text(usable)
    << " usable, a margin of " << size_text(margin) << " kept free, each block at " << kBlockFactor
    << "x its measured bytes, "
    << (complete ? "counted in the intervals where it is alive"
                 : "counted at the step's peak (not every block's interval was measured)");
  plan->reasons.push_back(o.str());
}

}  // namespace strata::step
