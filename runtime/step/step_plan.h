// The step-memory plan: what keeps one training step inside the device's and the host's memory,
// decided once, here, for every binding (issue 50). A binding measures (its allocator, its
// blocks' saved bytes, its batch) and executes (its hooks, its autograd); the decisions and the
// constants they use live in this module only:
//   - residency: how many of the first blocks stay in HBM (the rest stream);
//   - activations: which blocks keep what their backward needs (wholly, or only their matrix
//     products' and attention's outputs) instead of recomputing it;
//   - checkpoint homes: which blocks' inputs (their checkpoints) go to host memory, and where
//     neither the device nor the host can hold one per block, one per group of k blocks (the
//     others' inputs regenerated in the backward pass from their group's first: MegaTrain's
//     checkpoint interval);
//   - the host budget's split: the DRAM arena, and what is left beside it for the binding's
//     pools (paged optimizer state, spilled checkpoints);
//   - the loss chunk: how many tokens' logits exist at once;
//   - sequence tiles: over how many tiles of the batch's tokens the blocks' MLP runs, where one
//     block's backward working set at a long sequence does not fit whole (tiles.cpp);
//   - the optimizer state's tier: how much of the streamed blocks' state in DRAM an NVMe tier
//     should take so that the host's room holds the checkpoints the step needs (state_tier.cpp);
//   - transfers against compute: which streamed blocks load their weights slower than they
//     compute (a mixture-of-experts block's compute is its routed experts' share), and keep no
//     activations for that (transfers.cpp).
// Each decision is made when the profile carries what it needs (a binding plans residency at
// set-up, checkpoint homes at the first forward pass, kept activations once a step's peak is
// measured) and every choice carries its reason for the dump.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata::step {

// Constants, each with its reason; the only copy.
// Of the device memory left beside Strata's own and the rest of the model, the share resident
// blocks may take: the rest is for activations, logits and the allocator's caching.
inline constexpr uint64_t kResidentShareNumerator = 2;
inline constexpr uint64_t kResidentShareDenominator = 5;
// Device memory left unused by the plan, as a fraction of the device: 10% with a caching
// allocator (what fragmentation strands is as unusable as what is allocated), 4% with one that
// gives its cache back where an allocation needs it (torch's expandable segments).
inline constexpr double kMargin = 0.10;
inline constexpr double kMarginReturningCache = 0.04;
// With such an allocator, what it reserved beyond what it allocated is cache it gives back: a
// measured peak counts the allocated peak plus this fraction of the device (pages partly used,
// its rounding), or the reserved peak when that is less (an 8B at 32x1024 with paged state
// reserved to the device's size with 91-95 GB of 139 allocated).
inline constexpr double kFragmentationReturningCache = 0.02;
// A kept block's measured saved bytes are planned at this factor (the allocator's rounding and
// the transients of its backward beside them).
inline constexpr double kBlockFactor = 1.25;
// A block whose saved bytes could not be measured: its backward working set is taken as this
// many checkpoints (an 8B Llama block at 148 x 1024 saves ~14 of them).
inline constexpr uint64_t kUnmeasuredBlockFactor = 16;
// Spilled checkpoints restored ahead of the backward pass: the block's own and the next ones in
// backward order (enough to hide a copy behind one block's backward).
inline constexpr uint32_t kRestoreDepth = 2;
// Without a host budget, the share of the host memory available once the arena is made that the
// binding's pools may take (the paged state alone took half of it at the first step's end
// before the pools were counted together).
inline constexpr double kPoolShare = 0.5;
// The largest checkpoint group the plan forms (a binding may allow fewer): each block past a
// group's first is run once more in the backward pass, and a group's k-1 regenerated inputs are
// held together, so beyond 8 the recompute costs more than a spilled checkpoint's copies would.
inline constexpr uint32_t kMaxGroupBlocks = 8;
// The fp32 logits of one loss chunk.
inline constexpr uint64_t kLossChunkBytes = uint64_t{1} << 30;
// The shortest MLP tile the plan chooses (a user may give shorter ones): below it the MLP's
// matrix products ([tile, hidden] x [hidden, intermediate]) fall under the sizes that keep a GPU
// busy, and the per-tile overheads (a launch per op, the weight grads' sums) grow; ALST tiles at
// about the hidden size (4096 for an 8B).
inline constexpr uint64_t kMinTileTokens = 1024;
// A streamed block's weights are loaded for its forward pass and again for its backward pass.
inline constexpr double kPassesLoaded = 2;
// A block's compute in its forward pass's worth: the forward, the backward (the weight grads and
// the input grads: twice the forward's products) and, where it recomputes, the forward again.
inline constexpr double kPassesKept = 3;
inline constexpr double kPassesRecomputing = 4;

enum class Residency : int32_t { kChoose = 0, kResident = 1, kStreamed = 2 };
enum class Keep : int32_t { kRecompute = 0, kSelective = 1, kWhole = 2 };
enum class CheckpointHome : int32_t { kHbm = 0, kDram = 1 };
// Why the plan puts (or does not put) optimizer state on NVMe (strata.h STRATA_STEP_STATE_*).
enum class StateReason : uint32_t {
  kNotPlanned = 0,   // checkpoints were not planned
  kRoom = 1,         // the host's room holds the checkpoints the step needs: nothing moves
  kMove = 2,         // state to NVMe: its room goes to the checkpoints
  kDeviceShort = 3,  // short of device memory even with every checkpoint in host memory
  kNoNvme = 4,       // no NVMe tier (or it has no room)
  kNoState = 5,      // no optimizer state in DRAM to move
  kTooLittle = 6,    // all the state NVMe could take would not lower the checkpoint group
};

struct BlockProfile {
  uint64_t elements = 0;       // parameters of the block
  uint64_t rank_elements = 0;  // of them, what this process holds (data parallel); 0 = all
  // What it saves for its backward when not recomputed (0: unmeasured; a streamed block is never
  // kept wholly: that would keep its weights), and only its products' and attention's outputs
  // (0: cannot be kept so).
  uint64_t keep_whole_bytes = 0;
  uint64_t keep_selective_bytes = 0;
  Residency residency = Residency::kChoose;  // fixed by an earlier plan, or to choose
  Keep keep = Keep::kRecompute;              // how it keeps now (what the checkpoint plan counts)
  // FLOPs of its forward pass a token through its weights (0: a dense block's 2 x elements; a
  // mixture-of-experts block's: its routed experts' top_k / n share and all the rest).
  uint64_t active_flops = 0;
};

// A point of a measured step where a block begins its forward or backward pass with grad (or
// the step ends), and the framework's allocated and reserved peaks in the interval that ended
// there.
enum class PointKind : int32_t { kForward = 0, kBackward = 1, kEnd = 2 };
struct Interval {
  PointKind kind = PointKind::kForward;
  uint32_t block = 0;  // model order (0 for kEnd)
  uint64_t allocated_peak = 0;
  uint64_t reserved_peak = 0;
};

struct StepProfile {
  std::vector<BlockProfile> blocks;  // model order: the resident blocks first
  // Device (bytes; device_total 0: no device, nothing planned on it). free: what it has free
  // now; framework_held: what the framework's allocator holds (free + held = what it could
  // hold); allocator_returns_cache: its cache is given back where an allocation needs it.
  uint64_t device_total = 0;
  uint64_t device_free = 0;
  uint64_t framework_held = 0;
  bool allocator_returns_cache = false;
  // The decisions asked for beyond residency (which CHOOSE blocks ask for).
  bool plan_checkpoints = false;
  bool plan_kept = false;
  // Residency (planned when some block is kChoose): Strata's HBM tier still to be allocated
  // (its slots), the parameters outside the blocks still coming to the device, the bytes a
  // resident parameter takes there (weight, grad, optimizer state), and with the streamed grads
  // in HBM their bytes per parameter and in all (0: in DRAM).
  uint64_t hbm_tier_bytes = 0;
  uint64_t outside_elements = 0;
  uint64_t resident_bytes_per_param = 0;
  uint64_t streamed_grad_bytes_per_param = 0;
  uint64_t streamed_grads_hbm_bytes = 0;
  // Checkpoint homes: the batch's tokens, one checkpoint's bytes, what
  // one block saves for its backward at this batch (block_saved_measured false: unmeasured),
  // what the framework holds at the forward pass's start (in_use), the grads its backward pass
  // will allocate, and bytes leaving the device before the loss (paged state).
  uint64_t tokens = 0;
  uint64_t checkpoint_bytes = 0;
  uint64_t block_saved_bytes = 0;
  bool block_saved_measured = false;
  uint64_t in_use = 0;
  uint64_t backward_grad_bytes = 0;
  uint64_t leaving_bytes = 0;
  // Loss: the head's vocabulary and hidden size (0: no head), whether it runs over chunks, a
  // chunk given by the user (0: the default) and its working set if the binding knows it (0:
  // from the vocabulary).
  uint64_t vocab = 0;
  uint64_t hidden = 0;
  bool loss_chunked = false;
  uint64_t loss_chunk_tokens = 0;
  uint64_t loss_working_bytes = 0;
  // Kept activations: the measured step's allocated and reserved peaks and the intervals
  // between block starts.
  uint64_t step_allocated_peak = 0;
  uint64_t step_reserved_peak = 0;
  std::vector<Interval> intervals;
  // Host (bytes). host_budget: the user's (0: the default); arena: the DRAM tier's budget;
  // host_available: the host's available memory now (after the arena); ranks_on_host: processes
  // of this host each making such a budget; beside: pinned bytes the binding holds beside the
  // arena that it cannot do without.
  uint64_t host_budget = 0;
  uint64_t arena_bytes = 0;
  uint64_t host_available = 0;
  uint32_t ranks_on_host = 1;
  uint64_t beside_bytes = 0;
  // Checkpoint groups: the host memory spilled checkpoints may take (the binding's room in its
  // budget and the machine's; UINT64_MAX: unbounded), and the most blocks the binding can
  // regenerate from one checkpoint (1: every block keeps its own).
  uint64_t host_room = UINT64_MAX;
  uint32_t max_group = 1;
  uint32_t given_group = 0;  // groups of this many, the user's (0: the plan chooses)
  // Sequence tiles: of block_saved, what the block's MLP saves per token (0: unknown, never
  // tiled by the plan), and the user's tile count (0: the plan chooses).
  uint64_t mlp_token_bytes = 0;
  uint32_t given_tiles = 0;
  // The optimizer state's tier: the streamed blocks' state in DRAM (counted in the host's
  // budget), and what the NVMe tier can still take (0: no NVMe tier).
  uint64_t state_dram = 0;
  uint64_t nvme_free = 0;
  // Transfers against compute (with tokens): the host-to-device link's rate, the device's
  // achieved FLOP/s and the bytes a streamed weight moves a parameter (any 0: not judged).
  double h2d_bytes_per_second = 0;
  double device_flops_per_second = 0;
  uint32_t weight_bytes_per_param = 0;
};

struct BlockPlan {
  Residency residency = Residency::kStreamed;
  Keep keep = Keep::kRecompute;
  CheckpointHome checkpoint = CheckpointHome::kHbm;
  // The block whose checkpoint this block's input is regenerated from (its own index when it
  // keeps one; an earlier one when its group's first blocks are run again for it).
  uint32_t group_start = 0;
  uint32_t mlp_tiles = 1;       // the sequence tiles its MLP runs over (1: whole)
  bool transfer_bound = false;  // streamed, its loads longer than its compute (transfers.cpp)
};

struct StepPlan {
  std::vector<BlockPlan> blocks;
  uint32_t resident_blocks = 0;
  bool residency_planned = false;
  // Checkpoint homes: how many of the first blocks spill, whether the step is then predicted
  // inside the device, and what one backward block may allocate beyond what it holds at its
  // start (its working set, the restores in flight, the margin).
  bool checkpoints_planned = false;
  uint32_t spilled_checkpoints = 0;
  uint32_t group_blocks = 1;   // the checkpoint group chosen (1: one checkpoint per block)
  uint64_t spilled_bytes = 0;  // host memory the spilled checkpoints take
  bool fits = true;
  uint64_t predicted_peak = 0;
  uint64_t backward_reserve_bytes = 0;
  // Kept activations: the measured peak judged and what was usable.
  bool keep_planned = false;
  uint32_t kept_blocks = 0;   // of the final blocks, keeping any way
  uint32_t whole_blocks = 0;  // of them, wholly
  uint64_t judged_peak = 0;
  uint64_t usable_bytes = 0;
  uint64_t margin_bytes = 0;
  uint64_t host_total_bytes = 0;  // the host budget as the plan counts it (0: no host figures)
  uint64_t loss_chunk_tokens = 0;
  // Sequence tiles of the recomputing blocks' MLP, and each tile's tokens (0: not planned).
  uint32_t mlp_tiles = 1;
  uint64_t mlp_tile_tokens = 0;
  // The optimizer state's tier: of the profile's state_dram, what the plan puts on NVMe so the
  // host's room holds the checkpoints, the checkpoint group with it, and why.
  uint64_t state_nvme_bytes = 0;
  uint32_t state_group_blocks = 1;
  StateReason state_reason = StateReason::kNotPlanned;
  // Transfers against compute: whether judged, and how many streamed blocks are transfer-bound.
  bool transfers_judged = false;
  uint32_t transfer_bound_blocks = 0;
  std::vector<std::string> reasons;  // one line per decision made, for the dump
};

// Sums and products of the profile's figures never wrap: a figure past 2^64 is as good as
// infinite for every comparison the plan makes.
inline uint64_t sat_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}
inline uint64_t sat_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
// `value` fits under `usable` less `margin` (nothing does when the margin is the whole of it).
inline bool within(uint64_t value, uint64_t usable, uint64_t margin) {
  return usable >= margin && value <= usable - margin;
}

// Bytes for people: "1.24 GiB", "256.0 KiB", "12 B" (the dumps' unit at any scale).
std::string size_text(uint64_t bytes);

// Validates `profile` (names the field at fault) and plans what it carries.
Status plan_step(const StepProfile& profile, StepPlan* out);

// The decisions (residency.cpp, checkpoints.cpp, kept.cpp), each also callable alone.
uint32_t choose_resident(const StepProfile& profile, std::string* why);
uint64_t margin_bytes(const StepProfile& profile);
// How many of the first blocks spill their checkpoints (`checkpoints`: each block's bytes, 0
// where it keeps none), and whether the step then fits; `peak` and `restoring` (optional) get
// the predicted peak and the bytes of spilled checkpoints in flight back at that count.
uint32_t choose_spills(const std::vector<uint64_t>& checkpoints, uint64_t base, uint64_t working,
                       uint64_t usable, uint64_t margin, bool* fits, uint32_t depth = kRestoreDepth,
                       uint64_t* peak = nullptr, uint64_t* restoring = nullptr);
// Each block's group start with groups of `k` (runs of streamed blocks that recompute; any
// other block keeps its own checkpoint).
std::vector<uint32_t> group_starts(const StepProfile& profile, const StepPlan& plan, uint32_t k);
void plan_checkpoints(const StepProfile& profile, StepPlan* plan);
// The figures every checkpoint grouping of one profile shares: the device's usable bytes and
// margin, the loss's working set, the paged state leaving before it, what kept blocks hold,
// and what the step holds beside its checkpoints (base).
struct StepFigures {
  uint64_t usable = 0, margin = 0, loss = 0, leaving = 0, kept = 0, base = 0;
};
StepFigures step_figures(const StepProfile& profile, const StepPlan& plan);
// One grouping's outcome: how many of the first checkpoints spill, their bytes, whether the
// step then fits (device and host), its peak, the restores in flight and one backward block's
// working set.
struct Spills {
  uint32_t count = 0;
  uint64_t bytes = 0;
  bool fits = true;
  uint64_t peak = 0;
  uint64_t inflight = 0;
  uint64_t working = 0;
};
// The checkpoint group, each block's group start, the MLP tiles and the spills the plan takes
// when the host's room for spilled checkpoints is `room` (plan_checkpoints passes the
// profile's; the optimizer state's tier asks what a larger room would give).
struct Grouping {
  uint32_t k = 1;
  std::vector<uint32_t> starts;
  uint32_t tiles = 1;
  Spills spills;
};
Grouping choose_grouping(const StepProfile& profile, const StepPlan& plan, const StepFigures& f,
                         uint64_t room);
// The optimizer state's tier (state_tier.cpp), once the checkpoints are planned (`chosen`).
void plan_state_tier(const StepProfile& profile, const StepFigures& f, const Grouping& chosen,
                     StepPlan* plan);
// Sequence tiles (tiles.cpp). One block's backward working set with its MLP over `tiles` tiles
// (what it saves for its backward at kBlockFactor, and its input's and output's grads; its
// saved bytes unmeasured: kUnmeasuredBlockFactor checkpoints, whatever the tiles).
uint64_t block_working(const StepProfile& profile, uint32_t tiles);
// The tokens of each of `tiles` tiles but the last (ceil(tokens / tiles)).
uint64_t tile_tokens(uint64_t tokens, uint32_t tiles);
// The most tiles the plan would choose at this batch (1 where the MLP's bytes are unknown or
// the batch is shorter than two kMinTileTokens tiles), or the user's count.
uint32_t most_tiles(const StepProfile& profile);
// The fewest tiles in [1, most_tiles] for which `fits(tiles)`; where none fits, the fewest that
// do as well as the most (`peak(tiles)` as low): tiling that does not lower the peak (the loss's
// working set above the block's) is not chosen. The user's count where given.
uint32_t choose_tiles(const StepProfile& profile, const std::function<bool(uint32_t)>& fits,
                      const std::function<uint64_t(uint32_t)>& peak);
// The dump's reason for the tiles chosen.
std::string tiles_reason(const StepProfile& profile, uint32_t tiles, bool fits);
// The kept modes, candidates in the order given (their (whole, selective) bytes at kBlockFactor;
// whole 0: only selectively), each counted in the intervals where it is alive: `intervals` are
// (the last block alive, peak), `order[i]` candidate i's place in the model.
std::vector<Keep> choose_kept(uint64_t usable, uint64_t margin,
                              const std::vector<std::pair<uint64_t, uint64_t>>& candidates,
                              const std::vector<std::pair<int64_t, uint64_t>>& intervals,
                              const std::vector<int64_t>& order);
void plan_kept(const StepProfile& profile, StepPlan* plan);
uint64_t host_total(const StepProfile& profile);
// Transfers against compute (transfers.cpp): a block's forward FLOPs a token (active_flops, or a
// dense block's 2 x elements), whether the profile has what judging needs, a streamed block's
// loads and its compute in seconds at the profile's batch, and the judgement of every streamed
// block (before kept activations, which skip the transfer-bound ones).
uint64_t block_flops(const BlockProfile& block);
bool transfers_judged(const StepProfile& profile);
double load_seconds(const StepProfile& profile, const BlockProfile& block);
double compute_seconds(const StepProfile& profile, const BlockProfile& block, Keep keep);
void judge_transfers(const StepProfile& profile, StepPlan* plan);
uint64_t default_loss_chunk(uint64_t vocab);

std::string dump_text(const StepProfile& profile, const StepPlan& plan);
std::string dump_json(const StepProfile& profile, const StepPlan& plan);

}  // namespace strata::step
