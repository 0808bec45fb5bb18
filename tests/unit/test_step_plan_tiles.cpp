// The step plan's sequence tiles (runtime/step/tiles.cpp): the block working set split into
// the sequence's part and the MLP's per-token part, the fewest tiles with which the step fits,
// the user's count, and the refusals.
#include <catch2/catch.hpp>

#include <random>

#include "runtime/step/step_plan.h"
#include "support/step_profiles.h"

using namespace strata;
using namespace strata::step;
using namespace strata::step::testing;

namespace {

// An 8B Llama's shape at 128k tokens of one sequence: 32 streamed blocks, 1 GiB checkpoints,
// the MLP's 14 GiB of intermediates (112 KiB a token) of a block's 18 GiB saved, 20 GiB held.
StepProfile long_sequence(uint64_t device) {
  StepProfile p = streamed_checkpoints(32, device, 131072, GB, 18 * GB, 20 * GB);
  p.mlp_token_bytes = 112 * 1024;  // x 128k tokens = 14 GiB
  return p;
}

}  // namespace

TEST_CASE("step plan: the working set splits into the sequence's part and the MLP's tiles") {
  StepProfile p = long_sequence(80 * GB);
  // Untiled: the model before tiles (18 x 1.25 + 2 x 1).
  CHECK(block_working(p, 1) == gb(18 * 1.25 + 2));
  // Two tiles: the rest (4 GiB) whole, 7 GiB of the MLP's.
  CHECK(block_working(p, 2) == gb((4 + 7) * 1.25 + 2));
  CHECK(tile_tokens(131072, 3) == 43691);
  CHECK(tile_tokens(131072, 1) == 131072);
  CHECK(most_tiles(p) == 128);  // tiles of 1024 tokens at the shortest
  p.mlp_token_bytes = 0;
  CHECK(most_tiles(p) == 1);  // unmeasured: never tiled by the plan
  CHECK(block_working(p, 4) == block_working(p, 1));
  p.block_saved_measured = false;
  CHECK(block_working(p, 1) == 16 * GB);  // kUnmeasuredBlockFactor checkpoints
}

TEST_CASE("step plan: the MLP is tiled only where the step does not fit whole") {
  // 80 GiB: every checkpoint spilled at most, the untiled working set fits (20 + 24.5 + 3
  // restoring <= 72): one tile.
  StepProfile p = long_sequence(80 * GB);
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.fits);
  CHECK(plan.mlp_tiles == 1);
  CHECK(plan.mlp_tile_tokens == 131072);
  for (const auto& b : plan.blocks) CHECK(b.mlp_tiles == 1);
  CHECK(dump_text(p, plan).find("mlp: 1 tile of 131072 tokens: one block's backward working "
                                "set of 24.50 GiB fits whole") != std::string::npos);
  // 48 GiB (43.2 usable past the margin): untiled 20 + 24.5 + 3 is short even with every
  // checkpoint out; two tiles (a working set of 11 x 1.25 + 2 = 15.75) fit with 28 spilled.
  p = long_sequence(48 * GB);
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.fits);
  CHECK(plan.mlp_tiles == 2);
  CHECK(plan.mlp_tile_tokens == 65536);
  CHECK(plan.spilled_checkpoints == 28);
  CHECK(plan.group_blocks == 1);
  for (const auto& b : plan.blocks) CHECK(b.mlp_tiles == 2);
  const std::string text = dump_text(p, plan);
  CHECK(text.find("MLP over 2 tiles of 65536 tokens") != std::string::npos);
  CHECK(text.find("the fewest tiles with which the step fits") != std::string::npos);
  CHECK(text.find("  mlp tiles  ") != std::string::npos);
  CHECK(dump_json(p, plan).find("\"mlp_tiles\": 2") != std::string::npos);
  // A block keeping its activations is not tiled (it does not recompute).
  p.blocks[31].keep = Keep::kSelective;
  p.blocks[31].keep_selective_bytes = GB;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.blocks[31].mlp_tiles == 1);
  CHECK(plan.blocks[30].mlp_tiles == plan.mlp_tiles);
}

TEST_CASE("step plan: tiles where short even so, given tiles, and tiles that would not help") {
  // The host holds 16 checkpoints: 20 + w + 16 + 3 restoring never fits 43.2 (the rest of the
  // block alone is 5): the most tiles, the least short.
  StepProfile p = long_sequence(48 * GB);
  p.host_room = 16 * GB;
  StepPlan plan;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK_FALSE(plan.fits);
  CHECK(plan.mlp_tiles == 128);
  CHECK(plan.mlp_tile_tokens == 1024);
  CHECK(dump_text(p, plan).find("short even so: the tiles that lower the peak most") !=
        std::string::npos);
  // Groups come after tiles, where no tile count fits with one checkpoint per block: groups of
  // 2 (16 checkpoints, all in the host's room) fit with 2 tiles (20 + 15.75 + 1 regenerated
  // input + 3 restoring <= 43.2).
  p.max_group = 8;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.fits);
  CHECK(plan.group_blocks == 2);
  CHECK(plan.mlp_tiles == 2);
  // The loss's working set above any block's: tiling lowers nothing, one tile.
  p = long_sequence(48 * GB);
  p.loss_working_bytes = 30 * GB;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK_FALSE(plan.fits);
  CHECK(plan.mlp_tiles == 1);
  // The user's count, whatever fits, and at any batch.
  p = long_sequence(80 * GB);
  p.given_tiles = 5;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.mlp_tiles == 5);
  CHECK(plan.mlp_tile_tokens == 26215);
  CHECK(dump_text(p, plan).find("mlp: 5 tiles of 26215 tokens (given)") != std::string::npos);
  p.mlp_token_bytes = 0;  // unmeasured, still the user's
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.mlp_tiles == 5);
  // Unmeasured and short: never tiled.
  p = long_sequence(48 * GB);
  p.mlp_token_bytes = 0;
  REQUIRE(plan_step(p, &plan).is_ok());
  CHECK(plan.mlp_tiles == 1);
  CHECK(dump_text(p, plan).find("were not measured, it runs whole") != std::string::npos);
}

TEST_CASE("step plan: bad tile figures are refused, naming the field") {
  StepPlan plan;
  const auto says = [&](const StepProfile& p, const char* what) {
    const Status s = plan_step(p, &plan);
    CHECK(s.code() == Code::kInvalidArgument);
    INFO(s.message());
    CHECK(s.message().find(what) != std::string::npos);
  };
  StepProfile p = long_sequence(80 * GB);
  p.mlp_token_bytes = 200 * 1024;  // x 128k = 25 GiB, above the block's 18
  says(p, "mlp_token_bytes 204800 x tokens 131072 is more than block_saved_bytes");
  p = long_sequence(80 * GB);
  p.block_saved_measured = false;
  says(p, "was not measured");
  p = long_sequence(80 * GB);
  p.given_tiles = 131073;
  says(p, "mlp_tiles 131073 needs");
  p.given_tiles = 2;
  p.plan_checkpoints = false;
  says(p, "mlp_tiles 2 needs STRATA_STEP_PLAN_CHECKPOINTS");
  p = long_sequence(80 * GB);
  p.mlp_token_bytes = uint64_t{1} << 57;
  says(p, "mlp_token_bytes");
}

TEST_CASE("step plan: the tiles chosen are the fewest that fit, over many devices") {
  // Whatever the device: where the plan tiles and fits, one tile fewer (given) does not fit;
  // where it keeps the MLP whole, the step fits whole or no tile count would lower its peak.
  std::mt19937_64 random(53);
  for (int round = 0; round < 200; ++round) {
    StepProfile p = long_sequence(gb(30 + static_cast<double>(random() % 6000) / 100));
    p.host_room = random() % 2 ? UINT64_MAX : gb(static_cast<double>(random() % 3200) / 100);
    p.tokens = 4096 + random() % 262144;
    p.block_saved_bytes = 18 * GB * p.tokens / 131072;
    StepPlan plan, fewer;
    REQUIRE(plan_step(p, &plan).is_ok());
    INFO("round " << round << ": " << plan.mlp_tiles << " tiles");
    CHECK(plan.mlp_tiles >= 1);
    CHECK(plan.mlp_tiles <= most_tiles(p));
    if (plan.mlp_tiles > 1 && plan.fits) {
      p.given_tiles = plan.mlp_tiles - 1;
      REQUIRE(plan_step(p, &fewer).is_ok());
      CHECK_FALSE(fewer.fits);
    }
    if (plan.mlp_tiles == 1 && !plan.fits) {
      p.given_tiles = most_tiles(p);
      REQUIRE(plan_step(p, &fewer).is_ok());
      CHECK_FALSE(fewer.fits);
      CHECK(fewer.predicted_peak >= plan.predicted_peak);
    }
  }
}
