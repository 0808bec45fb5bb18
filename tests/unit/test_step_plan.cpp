// The step-memory plan's decisions (runtime/step/step_plan.h) on given sizes: residency,
// checkpoint homes, kept activations, the host budget and the loss chunk. (These cases were
// strata.torch's tests of the same rules when they lived in Python.)
#include <catch2/catch.hpp>

#include <random>

#include "runtime/step/step_plan.h"
#include "support/step_profiles.h"

using namespace strata;
using namespace strata::step;
using namespace strata::step::testing;

namespace {

std::pair<uint32_t, bool> spills(const std::vector<uint64_t>& ckpts, uint64_t base,
                                 uint64_t working, uint64_t usable, uint64_t margin,
                                 uint32_t depth = kRestoreDepth) {
  bool fits = true;
  const uint32_t n = choose_spills(ckpts, base, working, usable, margin, &fits, depth);
  return {n, fits};
}

// The kept plan at the step's peak (every block alive in one interval).
std::vector<Keep> at_peak(uint64_t usable, uint64_t peak,
                          const std::vector<std::pair<uint64_t, uint64_t>>& blocks,
                          uint64_t margin) {
  return choose_kept(usable, margin, blocks, {{0, peak}}, std::vector<int64_t>(blocks.size(), 0));
}

std::pair<std::size_t, std::size_t> modes(const std::vector<Keep>& plan) {
  return {plan.size(),
          static_cast<std::size_t>(std::count(plan.begin(), plan.end(), Keep::kWhole))};
}

constexpr Keep S = Keep::kSelective;
constexpr Keep W = Keep::kWhole;

// The last block alive in the interval ending at each point (as plan_kept computes it).
std::vector<std::pair<int64_t, uint64_t>> timeline(
    int64_t count, const std::vector<std::tuple<PointKind, int64_t, uint64_t>>& points) {
  std::vector<std::pair<int64_t, uint64_t>> out;
  for (auto [kind, block, peak] : points) {
    int64_t last = 0;
    if (kind == PointKind::kForward) last = block - 1;
    if (kind == PointKind::kBackward) last = block == count - 1 ? count - 1 : block + 1;
    out.emplace_back(last, peak);
  }
  return out;
}

}  // namespace

TEST_CASE("step plan: nothing spills when everything fits") {
  CHECK(spills(std::vector<uint64_t>(32, GB), 50 * GB, 10 * GB, 140 * GB, 5 * GB) ==
        std::pair<uint32_t, bool>{0, true});
}

TEST_CASE("step plan: the first blocks spill, as many as needed") {
  // 32 x 1.24 GiB of checkpoints, 85 GiB held, 12 GiB working set, 139 GiB usable, 5.6 GiB
  // margin: 39.7 GiB do not fit in the 36.4 left; each block spilled frees 1.24 GiB, the three
  // restores in flight cost 3.7 back.
  const uint64_t ckpt = gb(1.24);
  auto [count, fits] = spills(std::vector<uint64_t>(32, ckpt), 85 * GB, 12 * GB, 139 * GB, gb(5.6));
  CHECK(fits);
  const uint64_t limit = 139 * GB - gb(5.6) - 85 * GB - 12 * GB;
  CHECK((32 - count) * ckpt + 3 * ckpt <= limit);
  CHECK(limit < (32 - count + 1) * ckpt + 3 * ckpt);
  CHECK(count == 6);
}

TEST_CASE("step plan: every block spills and the step is short when even that does not fit") {
  CHECK(spills(std::vector<uint64_t>(4, GB), 100 * GB, 50 * GB, 140 * GB, 0) ==
        std::pair<uint32_t, bool>{4, false});
}

TEST_CASE("step plan: blocks keeping their activations have no checkpoint to spill") {
  // The last two (resident blocks keeping their activations) count 0: spilling reaches them and
  // frees nothing; the restores in flight are the spilled ones'.
  const std::vector<uint64_t> ckpts{GB, GB, GB, 0, 0};
  using R = std::pair<uint32_t, bool>;
  CHECK(spills(ckpts, 10 * GB, GB, 14 * GB, 0, 0) == R{0, true});
  // One spilled frees 1 GiB and its restore (depth 0: the block's own) takes it back.
  CHECK(spills(ckpts, 10 * GB, GB, gb(13.5), 0, 0) == R{2, true});
  CHECK(spills(ckpts, 10 * GB, GB, 12 * GB, 0, 0) == R{3, true});
  CHECK(spills(ckpts, 10 * GB, GB, gb(11.5), 0, 0) == R{5, false});
}

TEST_CASE("step plan: restores in flight are counted") {
  using R = std::pair<uint32_t, bool>;
  CHECK(spills({GB, GB}, 0, 0, GB, 0, 0) == R{2, true});
  CHECK(spills({GB, GB}, 0, 0, GB, 0, 1) == R{2, false});
}

TEST_CASE("step plan: blocks kept wholly, as many as fit") {
  using P = std::pair<std::size_t, std::size_t>;
  const auto whole_only = [](uint64_t bytes, std::size_t n) {
    return std::vector<std::pair<uint64_t, uint64_t>>(n, {bytes, 0});
  };
  CHECK(modes(at_peak(140 * GB, 100 * GB, whole_only(4 * GB, 28), 14 * GB)) == P{6, 6});
  CHECK(modes(at_peak(80 * GB, 79 * GB, whole_only(GB, 10), 8 * GB)) == P{0, 0});
  CHECK(modes(at_peak(140 * GB, GB, whole_only(GB, 5), 0)) == P{5, 5});
}

TEST_CASE("step plan: selective blocks are bought first, then upgraded") {
  using P = std::pair<std::size_t, std::size_t>;
  using B = std::vector<std::pair<uint64_t, uint64_t>>;
  // 26 GB spare: 5 blocks of 5 GB wholly, or 9 of 2.8 GB selectively (25.2), 0.8 left: none
  // upgraded (2.2 each).
  CHECK(modes(at_peak(140 * GB, 100 * GB, B(28, {5 * GB, gb(2.8)}), 14 * GB)) == P{9, 0});
  // 3 blocks only: all three selective (3 GB), 23 left upgrades all three (3 x 3 GB).
  CHECK(at_peak(140 * GB, 100 * GB, B(3, {4 * GB, GB}), 14 * GB) == std::vector<Keep>{W, W, W});
  // 3 blocks, 7 GB spare: three selective (3), 4 left upgrades the last one (3 each).
  CHECK(at_peak(140 * GB, 119 * GB, B(3, {4 * GB, GB}), 14 * GB) == std::vector<Keep>{W, S, S});
  // Selective no smaller than whole: kept wholly.
  CHECK(modes(at_peak(140 * GB, 100 * GB, B(28, {4 * GB, 4 * GB}), 14 * GB)) == P{6, 6});
  CHECK(at_peak(100 * GB, 100 * GB, B(28, {4 * GB, GB}), 14 * GB).empty());
}

TEST_CASE("step plan: blocks that differ, and the first that does not fit stops the plan") {
  // From the last back: 1 GB selective, a whole-only block of 3, 2 selective; 10 GB spare.
  const std::vector<std::pair<uint64_t, uint64_t>> blocks{
      {4 * GB, GB}, {3 * GB, 0}, {5 * GB, 2 * GB}, {GB, 0}};
  CHECK(at_peak(30 * GB, 20 * GB, blocks, 0) == std::vector<Keep>{W, W, S, W});
  CHECK(at_peak(26 * GB, 20 * GB, blocks, 0) == std::vector<Keep>{S, W, S});
  CHECK(at_peak(25 * GB, 20 * GB, blocks, 0) == std::vector<Keep>{S, W});
}

TEST_CASE("step plan: the timeline counts each kept block where it is alive") {
  // Blocks 0-1 resident, 2-4 streamed; each interval's peak in a step that kept nothing: 12
  // through the forward pass and the loss, 32 while block 3 goes backward (the paged state
  // coming), then 42 (the state back): the step's peak.
  using K = PointKind;
  std::vector<std::tuple<K, int64_t, uint64_t>> points;
  for (int64_t g = 0; g < 5; ++g) points.emplace_back(K::kForward, g, 12);
  for (auto [g, m] : {std::pair<int64_t, uint64_t>{4, 12}, {3, 12}, {2, 32}, {1, 42}, {0, 42}}) {
    points.emplace_back(K::kBackward, g, m);
  }
  points.emplace_back(K::kEnd, 0, 42);
  const auto intervals = timeline(5, points);
  const std::vector<std::pair<uint64_t, uint64_t>> blocks{
      {50, 20}, {50, 20}, {0, 20}, {0, 20}, {0, 20}};
  const std::vector<int64_t> order{1, 0, 4, 3, 2};
  CHECK(at_peak(100, 42, blocks, 0) == std::vector<Keep>{S, S});
  CHECK(choose_kept(100, 0, blocks, intervals, order) == std::vector<Keep>(4, S));
  CHECK(choose_kept(130, 0, blocks, intervals, order) == std::vector<Keep>(5, S));
  CHECK(choose_kept(150, 0, blocks, intervals, order) == std::vector<Keep>{W, S, S, S, S});
  std::vector<std::pair<int64_t, uint64_t>> flat;
  for (auto [last, peak] : intervals) flat.emplace_back(last, 42);
  for (uint64_t usable : {60, 100, 130, 200}) {
    CHECK(choose_kept(usable, 0, blocks, flat, order) == at_peak(usable, 42, blocks, 0));
  }
}

TEST_CASE("step plan: the loss counts every kept block") {
  using K = PointKind;
  const auto intervals = timeline(4, {{K::kForward, 0, 10},
                                      {K::kForward, 1, 11},
                                      {K::kForward, 2, 12},
                                      {K::kForward, 3, 13},
                                      {K::kBackward, 3, 54},
                                      {K::kBackward, 2, 14},
                                      {K::kBackward, 1, 14},
                                      {K::kBackward, 0, 60},
                                      {K::kEnd, 0, 64}});
  const std::vector<int64_t> order{3, 2, 1, 0};
  using B = std::vector<std::pair<uint64_t, uint64_t>>;
  CHECK(at_peak(100, 64, B(4, {40, 0}), 0).empty());
  CHECK(choose_kept(100, 0, B(4, {40, 0}), intervals, order) == std::vector<Keep>{W});
  CHECK(choose_kept(100, 0, B(4, {40, 20}), intervals, order) == std::vector<Keep>{S, S});
}

TEST_CASE("step plan: the timeline never keeps less than the step's peak") {
  std::mt19937 rng(7);
  const auto pick = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t n = static_cast<int64_t>(pick(1, 8));
    const uint64_t peak = pick(10, 100);
    std::vector<std::tuple<PointKind, int64_t, uint64_t>> points;
    for (int64_t g = 0; g < n; ++g) {
      points.emplace_back(PointKind::kForward, g, pick(0, peak));
      points.emplace_back(PointKind::kBackward, g, pick(0, peak));
    }
    points.emplace_back(PointKind::kEnd, 0, peak);
    std::vector<std::pair<uint64_t, uint64_t>> blocks;
    std::vector<int64_t> order;
    for (int64_t g = 0; g < n; ++g) {
      blocks.emplace_back(pick(1, 30), pick(0, 1) ? 0 : pick(1, 30));
      order.push_back(n - 1 - g);
    }
    const uint64_t usable = pick(peak, 250), margin = pick(0, 10);
    CHECK(choose_kept(usable, margin, blocks, timeline(n, points), order).size() >=
          at_peak(usable, peak, blocks, margin).size());
  }
}

TEST_CASE("step plan: residency fits the device's share beside the rest of the model") {
  StepProfile p;
  p.blocks.assign(4, BlockProfile{100, 0, 0, 0, Residency::kChoose, Keep::kRecompute});
  p.device_total = 100000;
  p.resident_bytes_per_param = 16;
  // 40% of 10000 free: 4000, 1600 a block: 2 resident.
  p.device_free = 10000;
  CHECK(choose_resident(p, nullptr) == 2);
  // The embedding and head still to come (250 parameters at 16 B) leave 6000: 2400, one block.
  p.outside_elements = 250;
  CHECK(choose_resident(p, nullptr) == 1);
  // Strata's HBM tier comes out of it too.
  p.hbm_tier_bytes = 2000;
  CHECK(choose_resident(p, nullptr) == 1);
  p.hbm_tier_bytes = 3000;
  CHECK(choose_resident(p, nullptr) == 0);
  // At least one block streams, however large the device.
  p = StepProfile{};
  p.blocks.assign(3, BlockProfile{100, 0, 0, 0, Residency::kChoose, Keep::kRecompute});
  p.device_total = p.device_free = uint64_t{1} << 40;
  p.resident_bytes_per_param = 16;
  CHECK(choose_resident(p, nullptr) == 2);
  // No device: none.
  p.device_total = p.device_free = 0;
  CHECK(choose_resident(p, nullptr) == 0);
  // Grads in HBM: their bytes come first, a resident block gives its own share back.
  p.device_total = p.device_free = 10000;
  p.streamed_grad_bytes_per_param = 4;
  p.streamed_grads_hbm_bytes = 1200;  // 3 blocks x 100 x 4
  // 4000 - 1200 = 2800; each block 1600 - 400 = 1200: two.
  CHECK(choose_resident(p, nullptr) == 2);
  p.streamed_grads_hbm_bytes = 2500;  // 1500 left: one
  CHECK(choose_resident(p, nullptr) == 1);
}

TEST_CASE("step plan: the host budget and the loss chunk") {
  StepProfile p;
  p.arena_bytes = 600;
  p.host_available = 1000;
  CHECK(host_total(p) == 600 + 500);
  p.ranks_on_host = 2;
  CHECK(host_total(p) == 600 + 250);
  p.beside_bytes = 100;
  CHECK(host_total(p) == 600 + 100 + 200);
  p.ranks_on_host = 4;
  p.beside_bytes = 300;
  CHECK(host_total(p) == 600 + 300);
  p.host_budget = 1000;
  CHECK(host_total(p) == 1000);
  // 1 GiB of fp32 logits at a 128k vocabulary: 2088 tokens (a multiple of 8).
  CHECK(default_loss_chunk(128256) == 2088);
  CHECK(default_loss_chunk(uint64_t{1} << 28) == 1);
  CHECK(default_loss_chunk(0) == 0);
}

TEST_CASE("step plan: a whole plan, each decision when its figures are given") {
  StepProfile p;
  p.blocks.assign(8, BlockProfile{1000, 0, 0, 0, Residency::kChoose, Keep::kRecompute});
  p.device_total = 100 * GB;
  p.device_free = 100 * GB;
  p.resident_bytes_per_param = 16;
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.residency_planned);
  CHECK(plan.resident_blocks == 7);
  CHECK_FALSE(plan.checkpoints_planned);
  CHECK_FALSE(plan.keep_planned);
  // Residency fixed, a batch of tokens: checkpoint homes.
  for (uint32_t i = 0; i < 8; ++i) {
    p.blocks[i].residency = i < 2 ? Residency::kResident : Residency::kStreamed;
  }
  p.plan_checkpoints = true;
  p.tokens = 4096;
  p.checkpoint_bytes = 10 * GB;
  p.block_saved_bytes = 4 * GB;
  p.block_saved_measured = true;
  p.framework_held = 0;
  p.in_use = 20 * GB;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.checkpoints_planned);
  CHECK(plan.resident_blocks == 2);
  // 80 GB of checkpoints, 20 held, a working set of 25 (4 x 1.25 + 2 x 10), 10 of margin:
  // 45 left for checkpoints and 3 restores in flight: 8 - n + 3 <= 4.5 -> n = 7.
  CHECK(plan.spilled_checkpoints == 7);
  CHECK(plan.fits);
  CHECK(plan.blocks[6].checkpoint == CheckpointHome::kDram);
  CHECK(plan.blocks[7].checkpoint == CheckpointHome::kHbm);
  CHECK(plan.backward_reserve_bytes == 25 * GB + 30 * GB + 10 * GB);
  CHECK(plan.predicted_peak == 20 * GB + 25 * GB + 10 * GB + 30 * GB);  // 1 in HBM, 3 restoring
  CHECK(dump_text(p, plan).find("checkpoints: 7 of 8") != std::string::npos);
}

TEST_CASE("step plan: bad profiles are refused, naming the field") {
  StepPlan plan;
  const auto says = [&](const StepProfile& p, const char* what) {
    const Status s = plan_step(p, &plan);
    CHECK(s.code() == Code::kInvalidArgument);
    INFO(s.message());
    CHECK(s.message().find(what) != std::string::npos);
  };
  StepProfile p;
  p.plan_checkpoints = true;
  p.device_total = 1;
  p.tokens = p.checkpoint_bytes = 1;
  says(p, "STRATA_STEP_PLAN_CHECKPOINTS needs");  // no blocks
  p = StepProfile{};
  p.blocks.assign(16385, BlockProfile{});
  says(p, "at most 16384");
  p.blocks.assign(2, BlockProfile{});
  p.resident_bytes_per_param = 16;
  p.blocks[0].residency = Residency::kStreamed;
  p.blocks[1].residency = Residency::kResident;
  says(p, "resident after a streamed");
  p.blocks[1].residency = Residency::kChoose;
  says(p, "CHOOSE and others' fixed");
  p.blocks[0].residency = Residency::kChoose;
  p.blocks[0].rank_elements = 5;
  says(p, "rank_elements");
  p.blocks[0].rank_elements = 0;
  p.max_group = 16385;
  says(p, "max_group_blocks 16385");
  p.max_group = 1;
  p.resident_bytes_per_param = 0;
  says(p, "resident_bytes_per_param 0");  // choosing residency needs it
  p.resident_bytes_per_param = 16;
  p.streamed_grad_bytes_per_param = 20;
  says(p, "more than resident_bytes_per_param");
  p.streamed_grad_bytes_per_param = 4;
  says(p, "disagree");  // grads in HBM without their total
  p.streamed_grad_bytes_per_param = 0;
  p.plan_checkpoints = true;
  p.tokens = 10;
  says(p, "needs a device");
  p.device_total = 10;
  p.checkpoint_bytes = 0;
  says(p, "checkpoint_bytes (0)");
  p.plan_checkpoints = false;
  p.device_free = 20;
  says(p, "device_free");
  p.device_free = 0;
  p.framework_held = 11;
  says(p, "framework_held");
  p.framework_held = 0;
  p.intervals.push_back({PointKind::kForward, 1, 0, 0});
  says(p, "without STRATA_STEP_PLAN_KEPT");
  p.plan_kept = true;
  p.intervals[0].block = 2;
  says(p, "interval 0's block 2");
  p.intervals[0] = {PointKind::kEnd, 1, 0, 0};
  says(p, "END with block 1");
  p.intervals[0] = {PointKind::kForward, 0, 5, 4};
  says(p, "not reserved >= allocated");
  p.intervals.clear();
  p.step_allocated_peak = 2;
  p.step_reserved_peak = 1;
  says(p, "step_reserved_peak 1 is below");
  p.step_allocated_peak = 0;
  p.blocks[0].keep = Keep::kSelective;
  says(p, "keep is not RECOMPUTE with STRATA_STEP_PLAN_KEPT");
  p.plan_kept = false;
  p.blocks[0].keep = Keep::kRecompute;
  for (auto& b : p.blocks) b.residency = Residency::kStreamed;
  p.blocks[1].keep = Keep::kWhole;
  says(p, "streamed and kept WHOLE");
  p.blocks[1].keep = Keep::kRecompute;
  p.host_budget = uint64_t{1} << 57;
  says(p, "host_budget");
}

TEST_CASE("step plan: figures near the caps do not wrap") {
  // 128 checkpoints of 2^56 bytes: their sum saturates instead of wrapping to a small number,
  // and the step is short, not predicted to fit.
  StepProfile p;
  p.blocks.assign(128, BlockProfile{1, 0, 0, 0, Residency::kStreamed, Keep::kRecompute});
  p.device_total = p.device_free = 80 * GB;
  p.plan_checkpoints = true;
  p.tokens = uint64_t{1} << 34;
  p.checkpoint_bytes = uint64_t{1} << 56;
  p.vocab = uint64_t{1} << 30;
  p.hidden = 8192;
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK_FALSE(plan.fits);
  CHECK(plan.spilled_checkpoints == 128);
  CHECK(plan.predicted_peak == UINT64_MAX);
}

TEST_CASE("step plan: kept activations are decided first, the checkpoints counted with them") {
  // Two resident blocks measured at 4 GB whole: kept (room for them), then their checkpoints
  // need no home and what they keep is counted in the checkpoint plan.
  StepProfile p;
  p.blocks.assign(4, BlockProfile{1000, 0, 4 * GB, 0, Residency::kStreamed, Keep::kRecompute});
  p.blocks[0].residency = p.blocks[1].residency = Residency::kResident;
  p.blocks[2].keep_whole_bytes = p.blocks[3].keep_whole_bytes = 0;  // streamed: unmeasured
  p.device_total = p.device_free = 100 * GB;
  p.plan_kept = true;
  p.step_allocated_peak = p.step_reserved_peak = 50 * GB;
  p.plan_checkpoints = true;
  p.tokens = 1024;
  p.checkpoint_bytes = GB;
  p.block_saved_measured = true;
  p.block_saved_bytes = GB;
  p.in_use = 10 * GB;
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.kept_blocks == 2);
  CHECK(plan.whole_blocks == 2);
  CHECK(plan.blocks[0].keep == Keep::kWhole);
  CHECK(plan.checkpoints_planned);
  CHECK(dump_text(p, plan).find("10.00 GiB kept by blocks") != std::string::npos);  // 2 x 5 GiB
}

TEST_CASE("step plan: checkpoints grouped where neither the device nor the host holds one each") {
  // Blocks saving 4 GB: a working set of 5 + 2 = 7. 24 GB held: 40 - 4 of margin - 24 - 7
  // leaves 5 for checkpoints and 3 restores in flight.
  StepProfile p = streamed_checkpoints(16, 40 * GB, 1024, GB, 4 * GB, 24 * GB);
  StepPlan plan;
  // Without a cap on the host's room: one checkpoint per block, 14 spilled (2 + 3 <= 5).
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.group_blocks == 1);
  CHECK(plan.spilled_checkpoints == 14);
  CHECK(plan.spilled_bytes == 14 * GB);
  CHECK(plan.fits);
  for (uint32_t i = 0; i < 16; ++i) CHECK(plan.blocks[i].group_start == i);
  // The host has room for 6: the binding that cannot regenerate inputs is short.
  p.host_room = 6 * GB;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.group_blocks == 1);
  CHECK_FALSE(plan.fits);
  CHECK(plan.spilled_checkpoints == 6);  // as many as the room takes
  CHECK(dump_text(p, plan).find("short even so") != std::string::npos);
  // One that can: groups of 2 need 7 spilled (8 - 7 + 3 <= 40 - 4 - 24 - 8), above the room;
  // groups of 3 (6 checkpoints: blocks 0, 3, .., 15) spill all 6 (0 + 3 <= 3).
  p.max_group = 4;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.group_blocks == 3);
  CHECK(plan.fits);
  CHECK(plan.spilled_checkpoints == 6);
  CHECK(plan.spilled_bytes == 6 * GB);
  const std::vector<uint32_t> starts = {0, 0, 0, 3, 3, 3, 6, 6, 6, 9, 9, 9, 12, 12, 12, 15};
  for (uint32_t i = 0; i < 16; ++i) {
    CHECK(plan.blocks[i].group_start == starts[i]);
    // The 6 groups' checkpoints all spilled; the others have none of their own (HBM reported).
    CHECK(plan.blocks[i].checkpoint ==
          (starts[i] == i ? CheckpointHome::kDram : CheckpointHome::kHbm));
  }
  CHECK(plan.backward_reserve_bytes == 7 * GB + 2 * GB + 3 * GB + 4 * GB);  // + 2 regenerated
  CHECK(dump_text(p, plan).find("one per group of 3") != std::string::npos);
  CHECK(dump_json(p, plan).find("\"checkpoint_group_blocks\": 3") != std::string::npos);
  // The user's group size, whatever fits (here: 4 heads, 3 spilled as the room takes).
  p.given_group = 4;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.group_blocks == 4);
  CHECK(plan.blocks[7].group_start == 4);
  p.given_group = 0;
  // A binding allowing 2 at most: short, with the largest group it allows.
  p.max_group = 2;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.group_blocks == 2);
  CHECK_FALSE(plan.fits);
}

TEST_CASE("step plan: groups form only in runs of streamed blocks that recompute") {
  StepProfile p;
  p.blocks.assign(9, BlockProfile{1000, 0, 0, GB, Residency::kStreamed, Keep::kRecompute});
  p.blocks[0].residency = p.blocks[1].residency = Residency::kResident;
  p.blocks[5].keep = Keep::kSelective;  // its recompute starts from its own checkpoint
  StepPlan plan;
  plan.blocks.resize(9);
  for (uint32_t i = 0; i < 9; ++i) {
    plan.blocks[i].residency = p.blocks[i].residency;
    plan.blocks[i].keep = p.blocks[i].keep;
  }
  CHECK(group_starts(p, plan, 2) == std::vector<uint32_t>{0, 1, 2, 2, 4, 5, 6, 6, 8});
  CHECK(group_starts(p, plan, 1) == std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(group_starts(p, plan, 8) == std::vector<uint32_t>{0, 1, 2, 2, 2, 5, 6, 6, 6});
}
