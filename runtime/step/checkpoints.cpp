// Checkpoint homes: which blocks' inputs leave the device for host memory between their forward
// and their backward pass. At 148 x 1024 tokens of an 8B Llama a block's input is 1.24 GB,
// 40 GB for 32 blocks, held through the whole forward pass.
#include <algorithm>
#include <functional>
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

uint64_t margin_bytes(const StepProfile& profile) {
  const double share = profile.allocator_returns_cache ? kMarginReturningCache : kMargin;
  return static_cast<uint64_t>(static_cast<double>(profile.device_total) * share);
}

// With n of the first blocks spilled the peak is base + working + the checkpoints not spilled +
// the restores in flight (the largest depth + 1 of the spilled ones). None spill when
// everything fits; all of them, and not fitting, when even that is short. The first blocks
// spill: their backward comes last, so their restores have the most time.
uint32_t choose_spills(const std::vector<uint64_t>& checkpoints, uint64_t base, uint64_t working,
                       uint64_t usable, uint64_t margin, bool* fits, uint32_t depth, uint64_t* peak,
                       uint64_t* restoring) {
  uint64_t total = 0;
  for (uint64_t c : checkpoints) total = sat_add(total, c);
  const uint64_t held = sat_add(base, working);
  // The peak with `spilled` bytes of checkpoints out and `inflight` of them coming back.
  const auto peak_with = [&](uint64_t spilled, uint64_t inflight) {
    return sat_add(sat_add(held, total - spilled), inflight);
  };
  *fits = true;
  if (peak != nullptr) *peak = peak_with(0, 0);
  if (restoring != nullptr) *restoring = 0;
  if (within(peak_with(0, 0), usable, margin)) return 0;
  std::vector<uint64_t> largest;  // the spilled ones, largest first
  uint64_t spilled = 0, inflight = 0;
  for (std::size_t n = 1; n <= checkpoints.size(); ++n) {
    spilled = sat_add(spilled, checkpoints[n - 1]);
    largest.insert(std::upper_bound(largest.begin(), largest.end(), checkpoints[n - 1],
                                    std::greater<uint64_t>()),
                   checkpoints[n - 1]);
    inflight = 0;
    for (std::size_t i = 0; i < largest.size() && i <= depth; ++i) {
      inflight = sat_add(inflight, largest[i]);
    }
    // (spilled cannot pass total unless both saturated: then nothing fits anyway)
    const uint64_t now = spilled > total ? UINT64_MAX : peak_with(spilled, inflight);
    if (peak != nullptr) *peak = now;
    if (restoring != nullptr) *restoring = inflight;
    if (within(now, usable, margin)) return static_cast<uint32_t>(n);
  }
  *fits = false;
  return static_cast<uint32_t>(checkpoints.size());
}

namespace {

// One block's backward working set at this batch: what it saves for its backward (its
// recompute) at kBlockFactor, and its input's and output's grads; unmeasured,
// kUnmeasuredBlockFactor checkpoints.
uint64_t block_working(const StepProfile& p) {
  if (!p.block_saved_measured) return sat_mul(kUnmeasuredBlockFactor, p.checkpoint_bytes);
  return sat_add(static_cast<uint64_t>(static_cast<double>(p.block_saved_bytes) * kBlockFactor),
                 sat_mul(2, p.checkpoint_bytes));
}

// The loss's working set: over chunks, one chunk's logits (compute dtype, fp32, and their grad)
// and the head's fp32 weight grad; whole, the logits in both dtypes and their grad in both.
uint64_t loss_working(const StepProfile& p, uint64_t chunk) {
  if (p.loss_working_bytes != 0) return p.loss_working_bytes;
  if (p.vocab == 0 || p.hidden == 0) return 0;
  if (p.loss_chunked && chunk) {
    return sat_add(sat_mul(sat_mul(8, std::min(p.tokens, chunk)), p.vocab),
                   sat_mul(sat_mul(4, p.vocab), p.hidden));
  }
  return sat_mul(sat_mul(12, p.tokens), p.vocab);
}

// What kept blocks hold at this batch (as the plan keeps them), at kBlockFactor: a resident one
// (no checkpoint: it keeps what its recompute would make) and a streamed one kept selectively
// (its checkpoint stays: its recompute starts from it).
uint64_t kept_bytes(const StepProfile& p, const StepPlan& plan) {
  uint64_t kept = 0;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const Keep keep = plan.blocks[i].keep;
    if (keep == Keep::kRecompute) continue;
    const auto& b = p.blocks[i];
    const bool whole = keep == Keep::kWhole || b.keep_selective_bytes == 0;
    const uint64_t use = whole ? b.keep_whole_bytes : b.keep_selective_bytes;
    kept = sat_add(kept, static_cast<uint64_t>(static_cast<double>(use) * kBlockFactor));
  }
  return kept;
}

}  // namespace

void plan_checkpoints(const StepProfile& p, StepPlan* plan) {
  const uint64_t usable = sat_add(p.device_free, p.framework_held);
  const uint64_t margin = margin_bytes(p);
  std::vector<uint64_t> checkpoints;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const bool resident = plan->blocks[i].residency == Residency::kResident;
    checkpoints.push_back(
        resident && plan->blocks[i].keep != Keep::kRecompute ? 0 : p.checkpoint_bytes);
  }
  const uint64_t working = std::max(block_working(p), loss_working(p, plan->loss_chunk_tokens));
  // Paged optimizer state held now leaves at the forward pass's last block, before the loss, and
  // its copies back wait for room in the backward pass: it takes the working set's place, not a
  // share beside it (counted in full, an 8B's 31 GB at 148 x 1024 made every block spill and
  // still predicted no fit).
  const uint64_t leaving = std::min(p.leaving_bytes, p.in_use);
  const uint64_t kept = kept_bytes(p, *plan);
  const uint64_t base = sat_add(sat_add(p.in_use - leaving, p.backward_grad_bytes), kept);
  bool fits = true;
  uint64_t peak = 0, inflight = 0;
  const uint32_t count = choose_spills(checkpoints, base, std::max(working, leaving), usable,
                                       margin, &fits, kRestoreDepth, &peak, &inflight);
  for (uint32_t i = 0; i < count; ++i) plan->blocks[i].checkpoint = CheckpointHome::kDram;
  plan->checkpoints_planned = true;
  plan->spilled_checkpoints = count;
  plan->fits = fits;
  plan->predicted_peak = peak;
  plan->backward_reserve_bytes = sat_add(sat_add(working, inflight), margin);
  plan->usable_bytes = usable;
  plan->margin_bytes = margin;
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "checkpoints: " << count << " of " << p.blocks.size() << " ("
    << size_text(p.checkpoint_bytes) << " each at " << p.tokens
    << " tokens) to host memory: the step holds " << size_text(base)
    << " besides them (the framework's " << size_text(p.in_use) << " at the "
    << "forward pass's start less " << size_text(leaving) << " leaving before the loss, "
    << size_text(p.backward_grad_bytes) << " of grads to come, " << size_text(kept)
    << " kept by blocks), a backward working set of " << size_text(std::max(working, leaving))
    << " (one block's " << size_text(block_working(p))
    << (p.block_saved_measured ? "" : ", unmeasured") << ", the loss's "
    << size_text(loss_working(p, plan->loss_chunk_tokens)) << "), and " << size_text(usable)
    << " usable less a margin of " << size_text(margin) << "; predicted peak " << size_text(peak)
    << (fits ? "" : ", short even with every checkpoint in host memory");
  plan->reasons.push_back(o.str());
}

}  // namespace strata::step
