// The step-memory plan through the C ABI (strata.h "Step-memory plan"): what each function's
// comment promises, as a C caller sees it: inits, every refusal it lists with nothing written,
// output structs written only up to their struct_size, dumps with strata_plan_dump's buffer
// rules, destroy(NULL), and a plan that needs no runtime.
#include <cstring>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

struct Profile {
  std::vector<strata_step_block_t> blocks;
  std::vector<const strata_step_block_t*> pointers;
  strata_step_profile_t profile{};

  explicit Profile(uint32_t n) : blocks(n) {
    for (auto& b : blocks) {
      REQUIRE(strata_step_block_init(&b) == STRATA_OK);
      b.elements = 1000;
    }
    for (auto& b : blocks) pointers.push_back(&b);
    REQUIRE(strata_step_profile_init(&profile) == STRATA_OK);
    profile.blocks = pointers.data();
    profile.block_count = n;
    profile.device_total_bytes = 100000000;
    profile.device_free_bytes = 100000000;
    profile.resident_bytes_per_param = 16;
  }
};

std::string last_error() {
  return strata_last_error_message();
}

}  // namespace

TEST_CASE("step plan: inits set struct_size and the documented defaults", "[abi]") {
  strata_step_profile_t p;
  std::memset(&p, 0xab, sizeof p);
  REQUIRE(strata_step_profile_init(&p) == STRATA_OK);
  CHECK(p.struct_size == STRATA_STEP_PROFILE_STRUCT_SIZE);
  CHECK(p.block_count == 0);
  CHECK(p.blocks == nullptr);
  CHECK(p.intervals == nullptr);
  CHECK(p.flags == 0);
  CHECK(p.ranks_on_host == 1);
  CHECK(p.beside_bytes == 0);
  CHECK(p.host_room_bytes == UINT64_MAX);
  CHECK(p.max_group_blocks == 1);
  CHECK(p.checkpoint_group_blocks == 0);
  CHECK(p.mlp_token_bytes == 0);
  CHECK(p.mlp_tiles == 0);
  CHECK(p.state_dram_bytes == 0);
  CHECK(p.nvme_free_bytes == 0);
  CHECK(p.h2d_bytes_per_second == 0);
  CHECK(p.device_flops_per_second == 0);
  CHECK(p.weight_bytes_per_param == 0);
  strata_step_block_t b;
  std::memset(&b, 0xab, sizeof b);
  REQUIRE(strata_step_block_init(&b) == STRATA_OK);
  CHECK(b.struct_size == STRATA_STEP_BLOCK_STRUCT_SIZE);
  CHECK(b.residency == STRATA_RESIDENCY_CHOOSE);
  CHECK(b.keep == STRATA_KEEP_RECOMPUTE);
  CHECK(b.checkpoint_tier == STRATA_TIER_HBM);
  CHECK(b.mlp_tiles == 1);
  CHECK(b.active_flops == 0);
  CHECK(b.transfer_bound == 0);
  strata_step_interval_t t;
  REQUIRE(strata_step_interval_init(&t) == STRATA_OK);
  CHECK(t.struct_size == STRATA_STEP_INTERVAL_STRUCT_SIZE);
  CHECK(strata_step_profile_init(nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(strata_step_block_init(nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(strata_step_interval_init(nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("step plan: a plan without a runtime, its info, blocks and dumps", "[abi]") {
  Profile p(4);
  strata_step_plan_t* plan = nullptr;
  REQUIRE(strata_step_plan_create(&p.profile, &plan) == STRATA_OK);
  strata_step_plan_info_t info{};
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_info(plan, &info) == STRATA_OK);
  CHECK(info.blocks == 4);
  CHECK(info.planned == STRATA_STEP_PLANNED_RESIDENCY);
  CHECK(info.resident_blocks == 3);  // a large device: all but one block
  CHECK(info.fits == 1);
  CHECK(info.restore_depth == 2);
  CHECK(info.predicted_peak_bytes == 0);  // (checkpoints were not planned)
  CHECK(info.mlp_tiles == 1);
  CHECK(info.mlp_tile_tokens == 0);
  CHECK(info.state_nvme_bytes == 0);  // (checkpoints were not planned)
  CHECK(info.state_nvme_group_blocks == 1);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_NOT_PLANNED);
  CHECK(info.usable_bytes == 100000000);
  CHECK(info.margin_bytes == 10000000);
  strata_step_block_t out{};
  out.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_block(plan, 3, &out) == STRATA_OK);
  CHECK(out.residency == STRATA_RESIDENCY_STREAMED);
  CHECK(out.elements == 1000);
  REQUIRE(strata_step_plan_get_block(plan, 0, &out) == STRATA_OK);
  CHECK(out.residency == STRATA_RESIDENCY_RESIDENT);
  CHECK(strata_step_plan_get_block(plan, 4, &out) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("block index 4") != std::string::npos);

  // A newer caller's larger output struct: the library writes its own fields, nothing beyond;
  // a size that ends inside a field is refused and nothing is written.
  struct {
    strata_step_plan_info_t info;
    char guard[8];
  } large{};
  std::memset(&large, 0x5a, sizeof large);
  large.info.struct_size = sizeof(strata_step_plan_info_t) + sizeof large.guard;
  REQUIRE(strata_step_plan_get_info(plan, &large.info) == STRATA_OK);
  CHECK(large.info.blocks == 4);
  CHECK(large.info.struct_size == sizeof(strata_step_plan_info_t) + sizeof large.guard);
  for (char c : large.guard) CHECK(c == 0x5a);
  std::memset(&large, 0x5a, sizeof large);
  large.info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE - 1;
  CHECK(strata_step_plan_get_info(plan, &large.info) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(large.info.blocks == 0x5a5a5a5au);

  size_t length = 0;
  REQUIRE(strata_step_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &length) == STRATA_OK);
  std::string text(length + 1, '\0');
  REQUIRE(strata_step_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, text.data(), text.size(), &length) ==
          STRATA_OK);
  CHECK(text.find("residency: 3 of 4 blocks resident") != std::string::npos);
  CHECK(strata_step_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, text.data(), length, nullptr) ==
        STRATA_ERROR_INVALID_ARGUMENT);  // no room for the NUL
  CHECK(strata_step_plan_dump(plan, 7, nullptr, 0, &length) == STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_step_plan_dump(plan, STRATA_PLAN_FORMAT_JSON, nullptr, 0, &length) == STRATA_OK);
  CHECK(length > 0);
  CHECK(strata_step_plan_destroy(plan) == STRATA_OK);
  CHECK(strata_step_plan_destroy(nullptr) == STRATA_OK);
}

TEST_CASE("step plan: every refusal the header lists, nothing written", "[abi]") {
  strata_step_plan_t* const sentinel = reinterpret_cast<strata_step_plan_t*>(0x1);
  const auto refused = [&](Profile& p, const char* says) {
    strata_step_plan_t* plan = sentinel;
    CHECK(strata_step_plan_create(&p.profile, &plan) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(plan == sentinel);
    CHECK(last_error().find(says) != std::string::npos);
  };
  {
    Profile p(1);
    strata_step_plan_t* plan = sentinel;
    CHECK(strata_step_plan_create(nullptr, &plan) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(strata_step_plan_create(&p.profile, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
    CHECK(plan == sentinel);
  }
  {
    Profile p(1);
    p.profile.struct_size = 8;
    refused(p, "struct_size");
  }
  {
    Profile p(2);
    p.profile.blocks = nullptr;
    refused(p, "blocks is NULL");
  }
  {
    Profile p(2);
    p.pointers[1] = nullptr;
    refused(p, "blocks[1] is NULL");
  }
  {
    Profile p(1);
    p.profile.block_count = 16385;
    refused(p, "at most 16384");
  }
  {
    Profile p(2);
    p.blocks[0].residency = STRATA_RESIDENCY_RESIDENT;
    refused(p, "CHOOSE and others' fixed");
  }
  {
    Profile p(1);
    p.profile.flags = 1u << 20;
    refused(p, "unknown flags 0x100000");
  }
  {
    Profile p(1);
    p.profile.resident_bytes_per_param = 0;
    refused(p, "resident_bytes_per_param 0");
  }
  {
    Profile p(1);
    p.blocks[0].residency = STRATA_RESIDENCY_STREAMED;
    p.blocks[0].keep = STRATA_KEEP_WHOLE;
    refused(p, "streamed and kept WHOLE");
  }
  {
    Profile p(1);
    p.blocks[0].residency = STRATA_RESIDENCY_STREAMED;
    p.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS;
    p.profile.tokens = 16;
    refused(p, "checkpoint_bytes (0)");
  }
  {
    Profile p(1);
    p.blocks[0].residency = STRATA_RESIDENCY_STREAMED;
    p.blocks[0].keep = STRATA_KEEP_SELECTIVE;
    p.profile.flags = STRATA_STEP_PLAN_KEPT;
    refused(p, "keep is not RECOMPUTE");
  }
  {
    Profile p(1);
    p.profile.framework_held_bytes = p.profile.device_total_bytes + 1;
    refused(p, "framework_held");
  }
  {
    Profile p(2);
    p.blocks[0].residency = STRATA_RESIDENCY_STREAMED;
    p.blocks[1].residency = STRATA_RESIDENCY_RESIDENT;
    refused(p, "resident after a streamed block");
  }
  {
    Profile p(1);
    p.blocks[0].residency = 9;
    refused(p, "residency 9");
  }
  {
    Profile p(1);
    p.blocks[0].keep = -1;
    refused(p, "keep -1");
  }
  {
    Profile p(1);
    p.profile.interval_count = 1;
    refused(p, "intervals is NULL");
  }
  {
    Profile p(1);
    strata_step_interval_t t;
    REQUIRE(strata_step_interval_init(&t) == STRATA_OK);
    const strata_step_interval_t* points[] = {&t};
    p.profile.intervals = points;
    p.profile.interval_count = 1;
    refused(p, "without STRATA_STEP_PLAN_KEPT");
    p.profile.flags = STRATA_STEP_PLAN_KEPT;
    t.point = 5;
    refused(p, "kind 5");
    t.point = STRATA_STEP_POINT_BACKWARD;
    t.block = 1;
    refused(p, "interval 0's block 1");
    t.point = STRATA_STEP_POINT_END;
    refused(p, "END with block 1");
    t.block = 0;
    t.allocated_peak_bytes = 10;
    refused(p, "not reserved >= allocated");
  }
  {
    Profile p(1);
    p.profile.host_budget_bytes = uint64_t{1} << 60;
    refused(p, "host_budget");
  }
  {
    Profile p(1);
    p.blocks[0].rank_elements = 1001;
    refused(p, "rank_elements 1001");
  }
  {
    Profile p(1);
    p.profile.device_free_bytes = p.profile.device_total_bytes + 1;
    refused(p, "device_free");
  }
  {
    Profile p(1);
    p.blocks[0].residency = STRATA_RESIDENCY_STREAMED;
    p.profile.device_total_bytes = p.profile.device_free_bytes = 0;
    p.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS;
    p.profile.tokens = 16;
    p.profile.checkpoint_bytes = 64;
    refused(p, "needs a device");
  }
  {
    Profile p(0);
    p.profile.flags = STRATA_STEP_PLAN_KEPT;
    refused(p, "blocks (0)");
  }
  strata_step_plan_info_t info{};
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  CHECK(strata_step_plan_get_info(nullptr, &info) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(strata_step_plan_dump(nullptr, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, nullptr) ==
        STRATA_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("step plan: checkpoint groups through the ABI", "[abi]") {
  // 16 streamed blocks, 1 GiB checkpoints, a device whose room holds few of them and a host
  // whose room holds 6: one checkpoint per block fits neither, groups of 3 do.
  constexpr uint64_t GB = uint64_t{1} << 30;
  Profile q(16);
  for (auto& b : q.blocks) b.residency = STRATA_RESIDENCY_STREAMED;
  q.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS | STRATA_STEP_BLOCK_SAVED_MEASURED;
  q.profile.device_total_bytes = q.profile.device_free_bytes = 40 * GB;
  q.profile.tokens = 1024;
  q.profile.checkpoint_bytes = GB;
  q.profile.block_saved_bytes = 4 * GB;
  q.profile.in_use_bytes = 24 * GB;
  q.profile.host_room_bytes = 6 * GB;
  const auto plan = [&] {
    strata_step_plan_t* made = nullptr;
    REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
    return made;
  };
  strata_step_plan_info_t info;
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  // The default max_group_blocks (1): every block keeps its own, the step short.
  strata_step_plan_t* made = plan();
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.checkpoint_group_blocks == 1);
  CHECK(info.fits == 0);
  CHECK(info.spilled_checkpoint_bytes <= 6 * GB);
  strata_step_plan_destroy(made);
  // A binding that regenerates: groups of 3, every group's checkpoint in host memory.
  q.profile.max_group_blocks = 4;
  made = plan();
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.checkpoint_group_blocks == 3);
  CHECK(info.fits == 1);
  CHECK(info.spilled_checkpoints == 6);
  CHECK(info.spilled_checkpoint_bytes == 6 * GB);
  for (uint32_t i = 0; i < 16; ++i) {
    strata_step_block_t b;
    b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
    REQUIRE(strata_step_plan_get_block(made, i, &b) == STRATA_OK);
    CHECK(b.group_start == i / 3 * 3);
    CHECK(b.checkpoint_tier == (b.group_start == i ? STRATA_TIER_DRAM : STRATA_TIER_HBM));
  }
  std::size_t length = 0;
  REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &length) == STRATA_OK);
  std::string text(length + 1, '\0');
  REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, text.data(), text.size(), nullptr) ==
          STRATA_OK);
  CHECK(text.find("one per group of 3") != std::string::npos);
  strata_step_plan_destroy(made);
  // The user's size, whatever fits.
  q.profile.checkpoint_group_blocks = 5;
  made = plan();
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.checkpoint_group_blocks == 5);
  strata_step_plan_destroy(made);
  // Above 16384: refused, naming the field.
  q.profile.checkpoint_group_blocks = 16385;
  strata_step_plan_t* none = nullptr;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(none == nullptr);
  CHECK(last_error().find("checkpoint_group_blocks") != std::string::npos);
  q.profile.checkpoint_group_blocks = 0;
  q.profile.max_group_blocks = 16385;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("max_group_blocks") != std::string::npos);
}

TEST_CASE("step plan: the MLP's sequence tiles through the ABI", "[abi]") {
  // 32 streamed blocks at 128k tokens, 1 GiB checkpoints, a block's 18 GiB saved of which its
  // MLP's 14 GiB (112 KiB a token), 20 GiB held, a 48 GiB device: untiled short even with every
  // checkpoint in host memory, 2 tiles fit (runtime/step/tiles.cpp; the unit cases count it).
  constexpr uint64_t GB = uint64_t{1} << 30;
  Profile q(32);
  for (auto& b : q.blocks) b.residency = STRATA_RESIDENCY_STREAMED;
  q.blocks[31].keep = STRATA_KEEP_SELECTIVE;  // keeps: not tiled
  q.blocks[31].keep_selective_bytes = GB;
  q.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS | STRATA_STEP_BLOCK_SAVED_MEASURED;
  q.profile.device_total_bytes = q.profile.device_free_bytes = 48 * GB;
  q.profile.tokens = 131072;
  q.profile.checkpoint_bytes = GB;
  q.profile.block_saved_bytes = 18 * GB;
  q.profile.mlp_token_bytes = 112 * 1024;
  q.profile.in_use_bytes = 19 * GB;
  strata_step_plan_t* made = nullptr;
  REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
  strata_step_plan_info_t info;
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.fits == 1);
  CHECK(info.mlp_tiles == 2);
  CHECK(info.mlp_tile_tokens == 65536);
  strata_step_block_t b;
  b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_block(made, 0, &b) == STRATA_OK);
  CHECK(b.mlp_tiles == 2);
  REQUIRE(strata_step_plan_get_block(made, 31, &b) == STRATA_OK);
  CHECK(b.mlp_tiles == 1);
  // A size that no released header gave (the step plan is new in the unreleased 1.5, so the
  // struct before its tiles was never released) is refused, as docs/abi.md says.
  b.struct_size = STRATA_STRUCT_SIZE(strata_step_block_t, group_start);
  CHECK(strata_step_plan_get_block(made, 0, &b) == STRATA_ERROR_INVALID_ARGUMENT);
  std::size_t length = 0;
  REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &length) == STRATA_OK);
  std::string text(length + 1, '\0');
  REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, text.data(), text.size(), nullptr) ==
          STRATA_OK);
  CHECK(text.find("MLP over 2 tiles of 65536 tokens") != std::string::npos);
  CHECK(text.find("mlp: 2 tiles of 65536 tokens") != std::string::npos);
  strata_step_plan_destroy(made);
  // The user's count.
  q.profile.mlp_tiles = 3;
  REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.mlp_tiles == 3);
  CHECK(info.mlp_tile_tokens == 43691);
  strata_step_plan_destroy(made);
  // Refusals the header lists, nothing written.
  strata_step_plan_t* none = nullptr;
  q.profile.mlp_tiles = 131073;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(none == nullptr);
  CHECK(last_error().find("mlp_tiles 131073") != std::string::npos);
  q.profile.mlp_tiles = 0;
  q.profile.mlp_token_bytes = 200 * 1024;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("mlp_token_bytes") != std::string::npos);
  q.profile.mlp_token_bytes = 112 * 1024;
  q.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS;  // block_saved_bytes not measured
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("not measured") != std::string::npos);
  q.profile.mlp_token_bytes = 0;
  q.profile.mlp_tiles = 2;
  q.profile.flags = 0;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("needs STRATA_STEP_PLAN_CHECKPOINTS") != std::string::npos);
  CHECK(none == nullptr);
}

TEST_CASE("step plan: the optimizer state's tier through the ABI", "[abi]") {
  // 16 streamed blocks of 1 GiB checkpoints, a block's 4 GiB saved, 24 GiB held of 40: one
  // checkpoint per block spills 14, the host has room for 6, groups of 3 fit it
  // (tests/unit/test_step_plan_state.cpp counts it).
  constexpr uint64_t GB = uint64_t{1} << 30;
  Profile q(16);
  for (auto& b : q.blocks) b.residency = STRATA_RESIDENCY_STREAMED;
  q.profile.flags = STRATA_STEP_PLAN_CHECKPOINTS | STRATA_STEP_BLOCK_SAVED_MEASURED;
  q.profile.device_total_bytes = q.profile.device_free_bytes = 40 * GB;
  q.profile.tokens = 1024;
  q.profile.checkpoint_bytes = GB;
  q.profile.block_saved_bytes = 4 * GB;
  q.profile.in_use_bytes = 24 * GB;
  q.profile.host_room_bytes = 6 * GB;
  q.profile.max_group_blocks = 4;
  q.profile.state_dram_bytes = 20 * GB;
  q.profile.nvme_free_bytes = 100 * GB;
  const auto info_of = [&](strata_step_plan_info_t* info, std::string* text) {
    strata_step_plan_t* made = nullptr;
    REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
    info->struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
    REQUIRE(strata_step_plan_get_info(made, info) == STRATA_OK);
    std::size_t length = 0;
    REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &length) == STRATA_OK);
    text->assign(length + 1, '\0');
    REQUIRE(strata_step_plan_dump(made, STRATA_PLAN_FORMAT_TEXT, text->data(), text->size(),
                                  nullptr) == STRATA_OK);
    strata_step_plan_destroy(made);
  };
  strata_step_plan_info_t info;
  std::string text;
  info_of(&info, &text);
  CHECK(info.checkpoint_group_blocks == 3);  // this plan: the room as given
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_MOVE);
  CHECK(info.state_nvme_bytes == 8 * GB);
  CHECK(info.state_nvme_group_blocks == 1);
  CHECK(text.find("advised: 8.00 GiB of optimizer state to NVMe") != std::string::npos);
  // Moved and planned again, as the header says: that plan takes the group, with ROOM.
  q.profile.host_room_bytes += info.state_nvme_bytes;
  q.profile.state_dram_bytes -= info.state_nvme_bytes;
  q.profile.nvme_free_bytes -= info.state_nvme_bytes;
  info_of(&info, &text);
  CHECK(info.checkpoint_group_blocks == 1);
  CHECK(info.fits == 1);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_ROOM);
  CHECK(info.state_nvme_bytes == 0);
  CHECK(info.state_nvme_group_blocks == 1);
  // Each reason the header lists.
  q.profile.host_room_bytes = 6 * GB;
  q.profile.nvme_free_bytes = 0;
  info_of(&info, &text);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_NO_NVME);
  CHECK(info.state_nvme_group_blocks == 3);
  q.profile.nvme_free_bytes = 100 * GB;
  q.profile.state_dram_bytes = 0;
  info_of(&info, &text);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_NO_STATE);
  q.profile.state_dram_bytes = GB / 2;
  info_of(&info, &text);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_TOO_LITTLE);
  CHECK(info.state_nvme_bytes == 0);
  q.profile.in_use_bytes = 33 * GB;
  info_of(&info, &text);
  CHECK(info.state_tier_reason == STRATA_STEP_STATE_DEVICE_SHORT);
  // Sizes above 2^56 are refused like the profile's others.
  q.profile.nvme_free_bytes = (uint64_t{1} << 56) + 1;
  strata_step_plan_t* none = nullptr;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(none == nullptr);
  CHECK(last_error().find("nvme_free_bytes") != std::string::npos);
}

TEST_CASE("step plan: transfers against compute through the ABI", "[abi]") {
  // 4 streamed blocks of 100M parameters at 16k tokens, 25 GB/s, 400 TFLOP/s, bf16: a dense
  // block computes 32.8 ms against 16 ms of loads; one whose forward is 31.25 MFLOP a token (an
  // MoE block's routed share) 5.1 ms (tests/unit/test_step_plan_transfers.cpp counts it).
  Profile q(4);
  for (auto& b : q.blocks) {
    b.residency = STRATA_RESIDENCY_STREAMED;
    b.elements = 100000000;
  }
  q.blocks[3].active_flops = 31250000;
  q.profile.tokens = 16384;
  q.profile.h2d_bytes_per_second = 25e9;
  q.profile.device_flops_per_second = 400e12;
  q.profile.weight_bytes_per_param = 2;
  strata_step_plan_t* made = nullptr;
  REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
  strata_step_plan_info_t info;
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.transfer_bound_blocks == 1);
  strata_step_block_t b;
  b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
  REQUIRE(strata_step_plan_get_block(made, 3, &b) == STRATA_OK);
  CHECK(b.transfer_bound == 1);
  CHECK(b.active_flops == 31250000);
  REQUIRE(strata_step_plan_get_block(made, 2, &b) == STRATA_OK);
  CHECK(b.transfer_bound == 0);
  CHECK(b.active_flops == 0);  // as given: a dense block's counted
  strata_step_plan_destroy(made);
  // Without a rate, not judged.
  q.profile.device_flops_per_second = 0;
  REQUIRE(strata_step_plan_create(&q.profile, &made) == STRATA_OK);
  REQUIRE(strata_step_plan_get_info(made, &info) == STRATA_OK);
  CHECK(info.transfer_bound_blocks == 0);
  REQUIRE(strata_step_plan_get_block(made, 3, &b) == STRATA_OK);
  CHECK(b.transfer_bound == 0);
  strata_step_plan_destroy(made);
  // The refusals the header lists, nothing written.
  strata_step_plan_t* none = nullptr;
  q.profile.device_flops_per_second = -1;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("device_flops_per_second") != std::string::npos);
  q.profile.device_flops_per_second = 400e12;
  q.profile.h2d_bytes_per_second = 2e18;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("h2d_bytes_per_second") != std::string::npos);
  q.profile.h2d_bytes_per_second = 25e9;
  q.profile.weight_bytes_per_param = 65;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("weight_bytes_per_param") != std::string::npos);
  q.profile.weight_bytes_per_param = 2;
  q.blocks[3].active_flops = (uint64_t{1} << 56) + 1;
  CHECK(strata_step_plan_create(&q.profile, &none) == STRATA_ERROR_INVALID_ARGUMENT);
  CHECK(last_error().find("active_flops") != std::string::npos);
  CHECK(none == nullptr);
}
