// Checkpoint homes: which blocks' inputs leave the device for host memory between their forward
// and their backward pass. At 148 x 1024 tokens of an 8B Llama a block's input is 1.24 GB,
// 40 GB for 32 blocks, held through the whole forward pass.
#include <algorithm>
#include <functional>
#include <iomanip>
#include <sstream>
#include <tuple>

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

std::vector<uint32_t> group_starts(const StepProfile& p, const StepPlan& plan, uint32_t k) {
  std::vector<uint32_t> starts(p.blocks.size());
  uint32_t run = 0;  // blocks of the current run of groupable ones before this one
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const bool groupable =
        plan.blocks[i].residency == Residency::kStreamed && plan.blocks[i].keep == Keep::kRecompute;
    run = groupable ? run + 1 : 0;
    // A run's blocks form groups of k from its first; any other block starts its own.
    starts[i] =
        groupable && k > 1 ? static_cast<uint32_t>(i) - (run - 1) % k : static_cast<uint32_t>(i);
  }
  return starts;
}

namespace {

// The first `count` present checkpoints' bytes.
uint64_t first_bytes(const std::vector<uint64_t>& checkpoints, uint32_t count) {
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < count && i < checkpoints.size(); ++i) {
    bytes = sat_add(bytes, checkpoints[i]);
  }
  return bytes;
}

// Which of the first checkpoints spill with groups of k: the device decides how many must
// leave; the host's room, how many can. A group's backward holds its k-1 regenerated inputs
// beside one block's working set (the re-run forward passes, without grad, hold less).
Spills spills_with(const StepProfile& p, const StepPlan& plan, uint32_t k,
                   const std::vector<uint32_t>& starts, uint64_t base, uint64_t working,
                   uint64_t leaving, uint64_t usable, uint64_t margin, uint64_t room) {
  std::vector<uint64_t> checkpoints;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    const bool resident = plan.blocks[i].residency == Residency::kResident;
    const bool own = resident ? plan.blocks[i].keep == Keep::kRecompute : starts[i] == i;
    checkpoints.push_back(own ? p.checkpoint_bytes : 0);
  }
  Spills s;
  // What one backward block may allocate; the paged state coming back takes its place.
  s.working = sat_add(working, sat_mul(k - 1, p.checkpoint_bytes));
  const uint64_t peak_working = std::max(s.working, leaving);
  s.count = choose_spills(checkpoints, base, peak_working, usable, margin, &s.fits, kRestoreDepth,
                          &s.peak, &s.inflight);
  s.bytes = first_bytes(checkpoints, s.count);
  if (s.bytes > room) {
    // The host holds fewer: as many as its room takes stay spilled, the step short.
    s.fits = false;
    while (s.count > 0 && first_bytes(checkpoints, s.count) > room) --s.count;
    s.bytes = first_bytes(checkpoints, s.count);
    const uint64_t kept = first_bytes(checkpoints, static_cast<uint32_t>(checkpoints.size()));
    s.peak = sat_add(sat_add(base, peak_working), kept - s.bytes);
  }
  return s;
}

}  // namespace

StepFigures step_figures(const StepProfile& p, const StepPlan& plan) {
  StepFigures f;
  f.usable = sat_add(p.device_free, p.framework_held);
  f.margin = margin_bytes(p);
  f.loss = loss_working(p, plan.loss_chunk_tokens);
  // Paged optimizer state held now leaves at the forward pass's last block, before the loss, and
  // its copies back wait for room in the backward pass: it takes the working set's place, not a
  // share beside it (counted in full, an 8B's 31 GB at 148 x 1024 made every block spill and
  // still predicted no fit).
  f.leaving = std::min(p.leaving_bytes, p.in_use);
  f.kept = kept_bytes(p, plan);
  f.base = sat_add(sat_add(p.in_use - f.leaving, p.backward_grad_bytes), f.kept);
  return f;
}

Grouping choose_grouping(const StepProfile& p, const StepPlan& plan, const StepFigures& f,
                         uint64_t room) {
  // With groups of g: the fewest MLP tiles with which the step fits (tiles.cpp), and its spills.
  // Tiles come before larger groups: a tiled MLP runs its forward once more in the backward
  // pass, a group's blocks run whole forward passes again.
  const auto grouped_by = [&](uint32_t g, const std::vector<uint32_t>& starts) {
    const auto at = [&](uint32_t tiles) {
      const uint64_t working = std::max(block_working(p, tiles), f.loss);
      return spills_with(p, plan, g, starts, f.base, working, f.leaving, f.usable, f.margin, room);
    };
    const uint32_t tiles = choose_tiles(
        p, [&](uint32_t t) { return at(t).fits; }, [&](uint32_t t) { return at(t).peak; });
    return std::pair{tiles, at(tiles)};
  };
  // The smallest group that fits: one checkpoint per block first (no block runs again), larger
  // groups only where the device and the host together cannot hold one per block. Where none
  // fits, the one with the lowest predicted peak (the step is short; that is the least short).
  const uint32_t largest = std::max<uint32_t>(1, std::min(p.max_group, kMaxGroupBlocks));
  Grouping c;
  const std::vector<uint32_t> single = group_starts(p, plan, 1);
  c.starts = single;
  std::tie(c.tiles, c.spills) = grouped_by(1, c.starts);
  if (p.given_group > 1) {  // the user's group size, whatever fits
    c.k = p.given_group;
    c.starts = group_starts(p, plan, c.k);
    std::tie(c.tiles, c.spills) = grouped_by(c.k, c.starts);
  }
  for (uint32_t g = 2; p.given_group == 0 && !c.spills.fits && g <= largest; ++g) {
    std::vector<uint32_t> grouped = group_starts(p, plan, g);
    if (grouped == single) break;  // no run of streamed blocks to group
    auto [t_tiles, t] = grouped_by(g, grouped);
    if (t.fits || t.peak < c.spills.peak) {
      c.k = g, c.starts = std::move(grouped), c.spills = t, c.tiles = t_tiles;
    }
  }
  return c;
}

void plan_checkpoints(const StepProfile& p, StepPlan* plan) {
  const StepFigures f = step_figures(p, *plan);
  const uint64_t usable = f.usable, margin = f.margin, leaving = f.leaving, kept = f.kept,
                 base = f.base;
  Grouping chosen = choose_grouping(p, *plan, f, p.host_room);
  const uint32_t k = chosen.k, tiles = chosen.tiles;
  const std::vector<uint32_t>& starts = chosen.starts;
  const Spills& s = chosen.spills;
  // s.count: the first blocks whose checkpoints spill (those with one of their own).
  uint32_t spilled = 0, own = 0;
  for (std::size_t i = 0; i < p.blocks.size(); ++i) {
    plan->blocks[i].group_start = starts[i];
    const bool resident = plan->blocks[i].residency == Residency::kResident;
    const bool has = resident ? plan->blocks[i].keep == Keep::kRecompute : starts[i] == i;
    own += has;
    plan->blocks[i].mlp_tiles = plan->blocks[i].keep == Keep::kRecompute ? tiles : 1;
    if (has && i < s.count) {
      plan->blocks[i].checkpoint = CheckpointHome::kDram;
      ++spilled;
    }
  }
  plan->checkpoints_planned = true;
  plan->spilled_checkpoints = spilled;
  plan->spilled_bytes = s.bytes;
  plan->group_blocks = k;
  plan->fits = s.fits;
  plan->predicted_peak = s.peak;
  plan->backward_reserve_bytes = sat_add(sat_add(s.working, s.inflight), margin);
  plan->usable_bytes = usable;
  plan->margin_bytes = margin;
  plan->mlp_tiles = tiles;
  plan->mlp_tile_tokens = tile_tokens(p.tokens, tiles);
  std::ostringstream o;
  o << std::fixed << std::setprecision(2);
  o << "checkpoints: " << spilled << " of " << own << " (" << size_text(p.checkpoint_bytes)
    << " each at " << p.tokens << " tokens) to host memory";
  if (k > 1) {
    o << ", one per group of " << k
      << " streamed blocks (the others' inputs regenerated in the backward pass: one checkpoint "
         "per block fits neither the device nor the host's room of "
      << size_text(p.host_room) << ")";
  }
  o << ": the step holds " << size_text(base) << " besides them (the framework's "
    << size_text(p.in_use) << " at the forward pass's start less " << size_text(leaving)
    << " leaving before the loss, " << size_text(p.backward_grad_bytes) << " of grads to come, "
    << size_text(kept) << " kept by blocks), a backward working set of "
    << size_text(std::max(s.working, leaving)) << " (one block's "
    << size_text(block_working(p, tiles)) << (p.block_saved_measured ? "" : ", unmeasured")
    << ", the loss's " << size_text(loss_working(p, plan->loss_chunk_tokens));
  if (k > 1) o << ", a group's " << k - 1 << " regenerated inputs";
  o << "), and " << size_text(usable) << " usable less a margin of " << size_text(margin)
    << "; predicted peak " << size_text(s.peak);
  if (!s.fits) {
    o << ", short even so (the host's room for checkpoints: "
      << (p.host_room == UINT64_MAX ? std::string("unbounded") : size_text(p.host_room)) << ")";
  }
  plan->reasons.push_back(o.str());
  plan->reasons.push_back(tiles_reason(p, tiles, s.fits));
  plan_state_tier(p, f, chosen, plan);
}

}  // namespace strata::step
