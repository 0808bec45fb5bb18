// The step plan's transfers against compute (runtime/step/transfers.cpp): a
// streamed block whose weights load slower than it computes (a
// mixture-of-experts block, whose compute is its routed experts' share) is
// judged transfer-bound from the FLOPs and rates the binding gives, and keeps
// no activations (its recompute runs while its weights load); residency stays
// the first blocks.
#include <catch2/catch.hpp>

#include "runtime/step/step_plan.h"

using namespace strata;
using namespace strata::step;

namespace {

constexpr uint64_t GB = uint64_t{1} << 30;
constexpr uint64_t kElements = 100'000'000;
// A dense block's forward: 2 FLOPs a parameter a token. An MoE block of the
// same parameters, 90% of them in 128 experts of which 8 route each token: 2 x
// (10M + 90M x 8 / 128).
constexpr uint64_t kDenseFlops = 2 * kElements;
constexpr uint64_t kMoeFlops = 2 * (10'000'000 + 90'000'000 / 128 * 8);

// 2 resident and 6 streamed blocks at 16k tokens; loads of 2 x 200 MB at 25
// GB/s (16 ms), a dense block's 4 passes of 200 MFLOP a token at 400 TFLOP/s
// (32.8 ms), an MoE block's 5.1 ms.
StepProfile profile(uint64_t flops) {
  StepProfile p;
  p.blocks.assign(8, BlockProfile{kElements, 0, 10 * GB, 2 * GB, Residency::kStreamed,
                                  Keep::kRecompute, flops});
  p.blocks[0].residency = p.blocks[1].residency = Residency::kResident;
  for (std::size_t i = 2; i < 8; ++i) p.blocks[i].keep_selective_bytes = 8 * GB;
  p.tokens = 16384;
  p.h2d_bytes_per_second = 25e9;
  p.device_flops_per_second = 400e12;
  p.weight_bytes_per_param = 2;
  return p;
}

// A measured step that kept nothing peaking at 20 GB of a 100 GB device, 90
// usable: 70 spare.
void measured(StepProfile* p) {
  p->plan_kept = true;
  p->device_total = 100 * GB;
  p->device_free = 60 * GB;
  p->framework_held = 40 * GB;
  p->step_allocated_peak = p->step_reserved_peak = 20 * GB;
}

StepPlan planned(const StepProfile& p) {
  StepPlan plan;
  const Status s = plan_step(p, &plan);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return plan;
}

}  // namespace

TEST_CASE(
    "step plan transfers: a dense block computes longer than it loads, "
    "an MoE one not") {
  const StepProfile dense = profile(kDenseFlops);
  CHECK(load_seconds(dense, dense.blocks[2]) == Approx(0.016));
  CHECK(compute_seconds(dense, dense.blocks[2], Keep::kRecompute) ==
        Approx(4.0 * kDenseFlops * 16384 / 400e12));
  CHECK(compute_seconds(dense, dense.blocks[2], Keep::kSelective) ==
        Approx(3.0 * kDenseFlops * 16384 / 400e12));
  StepPlan plan = planned(dense);
  CHECK(plan.transfers_judged);
  CHECK(plan.transfer_bound_blocks == 0);
  for (const auto& b : plan.blocks) CHECK_FALSE(b.transfer_bound);
  const StepProfile moe = profile(kMoeFlops);
  plan = planned(moe);
  CHECK(plan.transfer_bound_blocks == 6);
  for (std::size_t i = 0; i < 8; ++i) CHECK(plan.blocks[i].transfer_bound == (i >= 2));
  const std::string text = dump_text(moe, plan);
  CHECK(text.find("transfers: 6 of 6 streamed blocks load their weights") != std::string::npos);
  CHECK(text.find("mixture-of-experts") != std::string::npos);
  CHECK(text.find("  transfer-bound\n") != std::string::npos);
  CHECK(dump_json(moe, plan).find("\"transfer_bound\": true") != std::string::npos);
  // Unknown FLOPs count as a dense block's: not transfer-bound here.
  plan = planned(profile(0));
  CHECK(plan.transfer_bound_blocks == 0);
  CHECK(block_flops(profile(0).blocks[0]) == kDenseFlops);
  // At a batch 8x larger the MoE blocks compute longer than they load.
  StepProfile big = profile(kMoeFlops);
  big.tokens *= 8;
  CHECK(planned(big).transfer_bound_blocks == 0);
}

TEST_CASE("step plan transfers: not judged without a batch or a rate") {
  StepProfile p = profile(kMoeFlops);
  p.tokens = 0;
  StepPlan plan = planned(p);
  CHECK_FALSE(plan.transfers_judged);
  CHECK(plan.transfer_bound_blocks == 0);
  CHECK(dump_text(p, plan).find("transfers:") == std::string::npos);
  p = profile(kMoeFlops);
  p.h2d_bytes_per_second = 0;
  CHECK_FALSE(planned(p).transfers_judged);
  p = profile(kMoeFlops);
  p.device_flops_per_second = 0;
  CHECK_FALSE(planned(p).transfers_judged);
  p = profile(kMoeFlops);
  p.weight_bytes_per_param = 0;
  CHECK_FALSE(planned(p).transfers_judged);
}

TEST_CASE(
    "step plan transfers: kept activations go to the blocks whose "
    "compute they save") {
  // Dense: both resident blocks and the 6 streamed ones keep selectively (5 +
  // 60 of the 70 spare at 1.25x), 5 left upgrades none (10 each).
  StepProfile dense = profile(kDenseFlops);
  measured(&dense);
  StepPlan plan = planned(dense);
  CHECK(plan.kept_blocks == 8);
  CHECK(plan.whole_blocks == 0);
  // MoE: the streamed blocks are transfer-bound, passed over; the resident ones
  // keep wholly.
  StepProfile moe = profile(kMoeFlops);
  measured(&moe);
  plan = planned(moe);
  CHECK(plan.kept_blocks == 2);
  CHECK(plan.whole_blocks == 2);
  for (std::size_t i = 2; i < 8; ++i) CHECK(plan.blocks[i].keep == Keep::kRecompute);
  CHECK(dump_text(moe, plan).find("6 transfer-bound streamed blocks passed over") !=
        std::string::npos);
}

TEST_CASE(
    "step plan transfers: residency stays the first blocks, and the dump "
    "says why") {
  // 3 dense blocks then 5 MoE ones (DeepSeek's layout), residency chosen: the
  // first blocks are resident whatever their FLOPs, and the dump names the
  // transfer-bound streamed ones.
  StepProfile p = profile(kMoeFlops);
  for (auto& b : p.blocks) b.residency = Residency::kChoose;
  for (std::size_t i = 0; i < 3; ++i) p.blocks[i].active_flops = kDenseFlops;
  p.device_total = p.device_free = 10 * GB;
  p.resident_bytes_per_param = 16;  // 1.6 GB a block in 40% of 10 GB: 2 resident
  const StepPlan plan = planned(p);
  CHECK(plan.resident_blocks == 2);
  CHECK(plan.blocks[0].residency == Residency::kResident);
  CHECK_FALSE(plan.blocks[2].transfer_bound);
  CHECK(plan.transfer_bound_blocks == 5);
  CHECK(dump_text(p, plan).find("cannot keep the transfer-bound ones resident") !=
        std::string::npos);
}

TEST_CASE("step plan transfers: bad figures are refused, naming them") {
  StepPlan plan;
  StepProfile p = profile(kMoeFlops);
  p.h2d_bytes_per_second = -1;
  Status s = plan_step(p, &plan);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("h2d_bytes_per_second") != std::string::npos);
  p = profile(kMoeFlops);
  p.device_flops_per_second = std::numeric_limits<double>::quiet_NaN();
  s = plan_step(p, &plan);
  CHECK(s.message().find("device_flops_per_second") != std::string::npos);
  p = profile(kMoeFlops);
  p.weight_bytes_per_param = 65;
  s = plan_step(p, &plan);
  CHECK(s.message().find("weight_bytes_per_param") != std::string::npos);
  p = profile(kMoeFlops);
  p.blocks[3].active_flops = (uint64_t{1} << 56) + 1;
  s = plan_step(p, &plan);
  CHECK(s.message().find("active_flops") != std::string::npos);
}
