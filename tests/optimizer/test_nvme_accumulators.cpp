// Gradient accumulators (explicit mode) homed on NVMe through the C ABI on the backend under
// test: they go to NVMe when DRAM is short and the sums stay exact; with no tier that holds
// them, the backward fails naming the remedies.
#include <string>
#include <vector>

#include "optimizer/nvme_support.h"

using namespace strata_test;

namespace {

uint64_t dram_used(Model& m) {
  strata_tier_usage_t u{};
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(m.rt.get(), STRATA_TIER_DRAM, &u));
  return u.used_bytes;
}

// Every param's held grad, as fp32, and its sum of squares.
std::vector<std::vector<float>> held_grads(Model& m, strata_optimizer_t* o,
                                           std::vector<double>* sums) {
  std::vector<std::vector<float>> out;
  for (auto& layer : m.weights) {
    for (std::size_t k = 0; k < layer.size(); ++k) {
      std::vector<float> g(static_cast<std::size_t>(m.sizes[k]));
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(o, layer[k], g.data(), g.size()));
      strata_grad_info_t info{};
      info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_optimizer_grad_info(o, layer[k], &info));
      sums->push_back(info.sum_squares);
      out.push_back(std::move(g));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("gradient accumulators go to NVMe when DRAM is short, and the sums stay exact",
          "[optimizer][nvme]") {
  struct Variant {
    const char* name;
    uint32_t placement;  // of the state
    uint64_t spare;      // DRAM left free after attach: less than the accumulators take
  };
  // The optimizer counts a layer's accumulators as 28 KiB of DRAM (each one's pages and a page
  // more: strata_layout_query's accum_bytes), 140 KiB for the 5 layers; on NVMe they take 20
  // KiB a layer, which a slot then holds beside the layer's state.
  for (const Variant& var : {
           Variant{"state in DRAM: the sums alone staged", STRATA_STATE_PLACEMENT_DRAM, 96 * 1024},
           Variant{"state on NVMe: the sums staged with it", STRATA_STATE_PLACEMENT_NVME,
                   96 * 1024},
       }) {
    DYNAMIC_SECTION(var.name) {
      ScratchDir scratch;
      strata_optimizer_config_t c = adamw_config();
      c.update_mode = STRATA_UPDATE_EXPLICIT;
      c.state_placement = var.placement;
      // What the model, its state and its slots take of DRAM, measured on a roomy runtime.
      uint64_t used = 0;
      {
        NvmeConfig roomy(scratch, 16 * kMiB, 64 * kMiB);
        Model probe = make_model(5, 42, backend_under_test(), {3000, 1100}, &roomy.config);
        OptimizerPtr o = make_optimizer(probe, c);
        Streamed st;
        attach_streamed(probe, o.get(), &st);
        used = dram_used(probe);
      }
      NvmeConfig nv(scratch, used + var.spare, 64 * kMiB);
      Model short_model = make_model(5, 42, backend_under_test(), {3000, 1100}, &nv.config);
      Model in_dram = make_model(5, 42, backend_under_test());
      OptimizerPtr on = make_optimizer(short_model, c);
      strata_optimizer_config_t cd = adamw_config();
      cd.update_mode = STRATA_UPDATE_EXPLICIT;
      OptimizerPtr od = make_optimizer(in_dram, cd);
      Streamed sn, sd;
      attach_streamed(short_model, on.get(), &sn);
      attach_streamed(in_dram, od.get(), &sd);
      REQUIRE(dram_used(short_model) == used);

      for (int s = 0; s < 4; ++s) {
        for (int micro = 0; micro < 3; ++micro) {
          streamed_pass(in_dram, sd.ex, s, micro);
          streamed_pass(short_model, sn.ex, s, micro);
          if (s == 1 && micro == 1) {
            // torch's clamp_ on p.grad mid-accumulation: written into the sum where it is.
            for (Model* m : {&in_dram, &short_model}) {
              strata_optimizer_t* o = m == &in_dram ? od.get() : on.get();
              strata_tensor_t* w = m->weights[4][0];
              std::vector<float> g(3000);
              STRATA_REQUIRE_OK(strata_optimizer_grad_read(o, w, g.data(), g.size()));
              for (float& x : g) x = std::clamp(x, -0.05f, 0.05f);
              STRATA_REQUIRE_OK(strata_optimizer_grad_write(o, w, g.data(), g.size()));
            }
          }
        }
        // The held sums (what clip_grad_norm_ measures and p.grad reads): bit for bit.
        std::vector<double> sums_d, sums_n;
        const auto gd = held_grads(in_dram, od.get(), &sums_d);
        const auto gn = held_grads(short_model, on.get(), &sums_n);
        REQUIRE(gn == gd);
        REQUIRE(sums_n == sums_d);
        for (Model* m : {&in_dram, &short_model}) {
          strata_optimizer_t* o = m == &in_dram ? od.get() : on.get();
          STRATA_REQUIRE_OK(strata_optimizer_set_group(o, 0, 1e-2f / (1 + s), 0.1f));
          STRATA_REQUIRE_OK(strata_optimizer_set_group(o, 1, 1e-2f / (1 + s), 0.f));
          STRATA_REQUIRE_OK(strata_optimizer_step(o));
          for (auto& layer : m->weights) {
            for (strata_tensor_t* w : layer) {
              STRATA_REQUIRE_OK(strata_optimizer_grad_zero(o, w, 0));
            }
          }
        }
      }
      STRATA_REQUIRE_OK(strata_optimizer_synchronize(od.get()));
      STRATA_REQUIRE_OK(strata_optimizer_synchronize(on.get()));
      REQUIRE(snapshot(short_model, on.get()) == snapshot(in_dram, od.get()));
      // The last layer's sums went to NVMe; the all-DRAM run kept every one in DRAM.
      REQUIRE(state_tier(short_model, on.get(), short_model.weights[4][0],
                         STRATA_STATE_GRAD_ACCUM) == STRATA_TIER_NVME);
      REQUIRE(state_tier(in_dram, od.get(), in_dram.weights[4][0], STRATA_STATE_GRAD_ACCUM) ==
              STRATA_TIER_DRAM);
      const strata_optimizer_stats_t st = stats_of(on.get());
      REQUIRE(st.staging_slots >= 1);
      // Every landing after the first of a step read its layer's sums and wrote them back.
      REQUIRE(st.nvme_write_bytes > 0);
      REQUIRE(st.nvme_read_bytes > 0);
      // Within the budget: the slots were laid out again in what DRAM had.
      strata_tier_usage_t u{};
      u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_runtime_tier_usage(short_model.rt.get(), STRATA_TIER_DRAM, &u));
      REQUIRE(u.used_bytes <= u.budget_bytes);
    }
  }
}

TEST_CASE("accumulating with no tier that holds the sums fails at the backward, naming remedies",
          "[optimizer][nvme]") {
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  uint64_t used = 0;
  {
    Model probe = make_model(3, 7, backend_under_test());
    OptimizerPtr o = make_optimizer(probe, c);
    Streamed st;
    attach_streamed(probe, o.get(), &st);
    used = dram_used(probe);
  }
  strata_runtime_config_t config = config_for(backend_under_test(), 64 * kMiB, used + 8192);
  Model m = make_model(3, 7, backend_under_test(), {3000, 1100}, &config);
  OptimizerPtr o = make_optimizer(m, c);
  Streamed st;
  attach_streamed(m, o.get(), &st);
  streamed_pass(m, st.ex, 0, 0);  // one backward: no sum needed
  std::string message;
  REQUIRE(step_until_failure(st.ex, 3, &message) == STRATA_ERROR_OUT_OF_MEMORY);
  INFO(message);
  REQUIRE(message.find("gradient accumulation") != std::string::npos);
  REQUIRE(message.find("86016 bytes") != std::string::npos);  // 3 layers x 28 KiB
  REQUIRE(message.find("no NVMe tier") != std::string::npos);
  REQUIRE(message.find("host_budget") != std::string::npos);
  REQUIRE(message.find("nvme=") != std::string::npos);
  // The sums in place on the GPU, and the HBM they would take: 3 layers x 4100 x 4 bytes.
  REQUIRE(message.find("grads=\"device\", grad_dtype=torch.float32") != std::string::npos);
  REQUIRE(message.find("49200 bytes") != std::string::npos);
  REQUIRE(message.find("grads='device'") == std::string::npos);  // that alone keeps them here
  // Nothing was left half done: the held grads are the one backward's, and a step updates.
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(o.get(), m.weights[0][0], &info));
  REQUIRE(info.has_grad == 1);
  STRATA_REQUIRE_OK(strata_optimizer_step(o.get()));
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(o.get()));
}
