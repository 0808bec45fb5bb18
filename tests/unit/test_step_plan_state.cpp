// The step plan's optimizer state tier (runtime/step/state_tier.cpp): where the host's room
// cannot hold the checkpoints the step wants spilled, how much of the streamed blocks' optimizer
// state an NVMe tier should take instead of coarser checkpoint groups, or why none.
#include <catch2/catch.hpp>

#include "runtime/step/step_plan.h"

using namespace strata;
using namespace strata::step;

namespace {

constexpr uint64_t GB = uint64_t{1} << 30;

// The grouping case of test_step_plan.cpp: 16 streamed blocks of a 1 GB checkpoint, a working
// set of 7, 24 held of 40 (4 of margin). One checkpoint per block spills 14; groups of 2 spill
// 7; groups of 3 spill their 6.
StepProfile profile(uint64_t room, uint32_t max_group) {
  StepProfile p;
  p.blocks.assign(16, BlockProfile{1000, 0, 0, 0, Residency::kStreamed, Keep::kRecompute});
  p.plan_checkpoints = true;
  p.device_total = 40 * GB;
  p.device_free = 40 * GB;
  p.tokens = 1024;
  p.checkpoint_bytes = GB;
  p.block_saved_bytes = 4 * GB;
  p.block_saved_measured = true;
  p.in_use = 24 * GB;
  p.host_room = room;
  p.max_group = max_group;
  return p;
}

StepPlan planned(const StepProfile& p) {
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  return plan;
}

bool says(const StepPlan& plan, const std::string& text) {
  for (const auto& why : plan.reasons) {
    if (why.find("optimizer state: ") == 0 && why.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("step plan state: none moves where the host's room holds the checkpoints") {
  StepProfile p = profile(UINT64_MAX, 4);
  p.state_dram = 20 * GB;
  p.nvme_free = 100 * GB;
  StepPlan plan = planned(p);
  CHECK(plan.group_blocks == 1);
  CHECK(plan.state_reason == StateReason::kRoom);
  CHECK(plan.state_nvme_bytes == 0);
  CHECK(plan.state_group_blocks == 1);
  CHECK(says(plan, "holds the 14.00 GiB the step spills"));
  // A room exactly the step's: still nothing to move.
  p.host_room = 14 * GB;
  plan = planned(p);
  CHECK(plan.state_reason == StateReason::kRoom);
  CHECK(plan.state_nvme_bytes == 0);
  // Without checkpoints planned the tier is not planned.
  p.plan_checkpoints = false;
  plan = planned(p);
  CHECK(plan.state_reason == StateReason::kNotPlanned);
  CHECK(plan.state_group_blocks == 1);
}

TEST_CASE("step plan state: the state NVMe takes before groups, and the plan again with it") {
  StepProfile p = profile(6 * GB, 4);
  p.state_dram = 20 * GB;
  p.nvme_free = 100 * GB;
  StepPlan plan = planned(p);
  // This plan's checkpoints are for the room as given: groups of 3.
  CHECK(plan.group_blocks == 3);
  CHECK(plan.fits);
  CHECK(plan.spilled_checkpoints == 6);
  // The advice: 8 GB of state to NVMe gives one checkpoint per block its 14.
  CHECK(plan.state_reason == StateReason::kMove);
  CHECK(plan.state_nvme_bytes == 8 * GB);
  CHECK(plan.state_group_blocks == 1);
  CHECK(says(plan, "8.00 GiB of the streamed blocks' optimizer state to NVMe"));
  CHECK(dump_text(p, plan).find("advised: 8.00 GiB of optimizer state to NVMe") !=
        std::string::npos);
  CHECK(dump_json(p, plan).find("\"state_tier_reason\": \"move\"") != std::string::npos);
  // The binding moved it and plans again: one checkpoint per block, nothing more to move.
  p.host_room += plan.state_nvme_bytes;
  p.state_dram -= plan.state_nvme_bytes;
  p.nvme_free -= plan.state_nvme_bytes;
  const StepPlan again = planned(p);
  CHECK(again.group_blocks == 1);
  CHECK(again.fits);
  CHECK(again.spilled_checkpoints == 14);
  CHECK(again.state_reason == StateReason::kRoom);
  CHECK(again.state_nvme_bytes == 0);
  // A binding that cannot regenerate inputs (groups of 1 only) is short with the room as given;
  // the same 8 GB make its step fit.
  p = profile(6 * GB, 1);
  p.state_dram = 20 * GB;
  p.nvme_free = 100 * GB;
  plan = planned(p);
  CHECK_FALSE(plan.fits);
  CHECK(plan.state_reason == StateReason::kMove);
  CHECK(plan.state_nvme_bytes == 8 * GB);
  CHECK(plan.state_group_blocks == 1);
  CHECK(says(plan, "short of memory"));
}

TEST_CASE("step plan state: part of what the step wants, where it lowers the group") {
  StepProfile p = profile(6 * GB, 4);
  p.state_dram = 20 * GB;
  p.nvme_free = GB;  // all NVMe can take: 1 GB, the 7 groups of 2 spill
  StepPlan plan = planned(p);
  CHECK(plan.group_blocks == 3);
  CHECK(plan.state_reason == StateReason::kMove);
  CHECK(plan.state_nvme_bytes == GB);
  CHECK(plan.state_group_blocks == 2);
  CHECK(says(plan, "gives groups of 2 instead of groups of 3"));
  // Moved and planned again: groups of 2; NVMe has nothing left to take.
  StepProfile moved = p;
  moved.host_room += GB;
  moved.state_dram -= GB;
  moved.nvme_free -= GB;
  const StepPlan again = planned(moved);
  CHECK(again.group_blocks == 2);
  CHECK(again.fits);
  CHECK(again.state_reason == StateReason::kNoNvme);
  // Less than that lowers nothing: none moves, and the dump says why.
  p.nvme_free = GB / 2;
  plan = planned(p);
  CHECK(plan.state_reason == StateReason::kTooLittle);
  CHECK(plan.state_nvme_bytes == 0);
  CHECK(plan.state_group_blocks == 3);
  CHECK(says(plan, "would not lower the checkpoint group (3)"));
  // The state is the limit as well as NVMe's room.
  p.nvme_free = 100 * GB;
  p.state_dram = GB;
  plan = planned(p);
  CHECK(plan.state_nvme_bytes == GB);
  CHECK(plan.state_group_blocks == 2);
}

TEST_CASE("step plan state: why none moves") {
  StepProfile p = profile(6 * GB, 4);
  p.state_dram = 20 * GB;
  p.nvme_free = 0;  // no NVMe tier: groups instead
  StepPlan plan = planned(p);
  CHECK(plan.group_blocks == 3);
  CHECK(plan.state_reason == StateReason::kNoNvme);
  CHECK(plan.state_nvme_bytes == 0);
  CHECK(plan.state_group_blocks == 3);
  CHECK(says(plan, "no NVMe tier"));
  CHECK(says(plan, "are grouped instead"));
  p.nvme_free = 100 * GB;
  p.state_dram = 0;
  plan = planned(p);
  CHECK(plan.state_reason == StateReason::kNoState);
  CHECK(says(plan, "no optimizer state in DRAM"));
  // The device short even with every checkpoint spilled: host memory would not help.
  p.state_dram = 20 * GB;
  p.in_use = 33 * GB;
  plan = planned(p);
  CHECK_FALSE(plan.fits);
  CHECK(plan.state_reason == StateReason::kDeviceShort);
  CHECK(plan.state_nvme_bytes == 0);
  CHECK(says(plan, "the device is short"));
}

TEST_CASE("step plan state: its figures are checked like the others") {
  StepProfile p = profile(6 * GB, 4);
  StepPlan plan;
  p.state_dram = (uint64_t{1} << 56) + 1;
  Status s = plan_step(p, &plan);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.message().find("state_dram_bytes") != std::string::npos);
  p.state_dram = 0;
  p.nvme_free = UINT64_MAX;
  s = plan_step(p, &plan);
  REQUIRE_FALSE(s.is_ok());
  CHECK(s.message().find("nvme_free_bytes") != std::string::npos);
}
