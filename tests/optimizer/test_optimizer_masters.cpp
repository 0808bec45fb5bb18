// The optimizer's masters and groups through the C ABI: weights loaded without the optimizer,
// master_read / master_write in every layout (and refused inside a step, and whole beside
// manual steps), a split master, grads homed in HBM, each group's hyperparameters read at every
// update and checked as the config's are.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <thread>
#include <tuple>

#include "optimizer/optimizer_model.h"
#include "support/device_views.h"

using namespace strata_test;

namespace {

// Every param's master, read whole (strata_optimizer_master_read), as fp32.
std::vector<std::vector<float>> masters_of(Model& m, strata_optimizer_t* o) {
  std::vector<std::vector<float>> out;
  for (auto& layer : m.weights) {
    for (std::size_t k = 0; k < layer.size(); ++k) {
      std::vector<float> v(static_cast<std::size_t>(m.sizes[k]));
      STRATA_REQUIRE_OK(strata_optimizer_master_read(o, layer[k], v.data(), v.size()));
      out.push_back(std::move(v));
    }
  }
  return out;
}

}  // namespace

TEST_CASE("weights loaded without the optimizer leave its masters; master_write sets them",
          "[checkpoint]") {
  ScratchDir scratch;
  const std::string ckpt = scratch.file("weights");
  for (uint32_t layout : {STRATA_MASTER_SEPARATE, STRATA_MASTER_SPLIT}) {
    DYNAMIC_SECTION("layout " << layout) {
      Model m = make_model(2, 9, STRATA_DEVICE_BACKEND_HOST);
      OptimizerPtr o = make_optimizer(m, adamw_config(), layout);
      run_manual(m, o.get(), 0, 2, 1);
      STRATA_REQUIRE_OK(strata_checkpoint_save(m.rt.get(), nullptr, ckpt.c_str()));
      const auto saved = bf16_weights(m);
      run_manual(m, o.get(), 2, 2, 1);  // the masters move on
      const auto before = masters_of(m, o.get());
      STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), nullptr, ckpt.c_str()));
      // The weights are the checkpoint's; a separate master is what it was (a split one
      // follows its weight: test_kernels.cpp's stale-rest cases).
      if (layout == STRATA_MASTER_SEPARATE) REQUIRE(masters_of(m, o.get()) == before);
      REQUIRE(bf16_weights(m) == saved);
      std::size_t i = 0;
      std::vector<std::vector<float>> widened;
      for (auto& layer : m.weights) {
        for (std::size_t k = 0; k < layer.size(); ++k, ++i) {
          std::vector<float> w(saved[i].size());
          for (std::size_t e = 0; e < w.size(); ++e) w[e] = from_bf16(saved[i][e]);
          STRATA_REQUIRE_OK(strata_optimizer_master_write(o.get(), layer[k], w.data(), w.size()));
          widened.push_back(std::move(w));
        }
      }
      REQUIRE(masters_of(m, o.get()) == widened);
    }
  }
}

TEST_CASE("a split master trains as a separate one, in 2 bytes per parameter less", "[optimizer]") {
  enum class Loop { kAuto, kClipped, kExplicit };
  for (Loop loop : {Loop::kAuto, Loop::kClipped, Loop::kExplicit}) {
    DYNAMIC_SECTION((loop == Loop::kAuto      ? "updates during the backward"
                     : loop == Loop::kClipped ? "clipped"
                                              : "explicit updates")) {
      strata_optimizer_config_t c = adamw_config();
      if (loop == Loop::kClipped) c.max_grad_norm = 0.5f;
      if (loop == Loop::kExplicit) c.update_mode = STRATA_UPDATE_EXPLICIT;
      Model sep = make_model(4, 21, backend_under_test());
      Model spl = make_model(4, 21, backend_under_test());
      OptimizerPtr so = make_optimizer(sep, c);
      OptimizerPtr po = make_optimizer(spl, c, STRATA_MASTER_SPLIT);
      Streamed ss, sp;
      attach_streamed(sep, so.get(), &ss);
      attach_streamed(spl, po.get(), &sp);
      for (auto [m, o, ex] : {std::tuple{&sep, so.get(), ss.ex}, {&spl, po.get(), sp.ex}}) {
        if (loop == Loop::kExplicit) {
          run_explicit(*m, o, ex, 0, 6, 1);
        } else {
          run_streamed(*m, o, ex, 0, 6, 1);
        }
      }
      // The weights streamed and updated are the same bits; the masters too, but for values
      // that landed exactly halfway between two bf16 values (one ulp: 2^-24 relative).
      const auto ms = masters_of(sep, so.get()), mp = masters_of(spl, po.get());
      std::size_t t = 0;
      uint64_t elements = 0;
      for (std::size_t l = 0; l < sep.weights.size(); ++l) {
        for (std::size_t k = 0; k < sep.sizes.size(); ++k, ++t) {
          const auto a = read_bf16(sep.rt.get(), sep.weights[l][k], sep.sizes[k]);
          const auto b = read_bf16(spl.rt.get(), spl.weights[l][k], spl.sizes[k]);
          REQUIRE(a == b);
          for (std::size_t i = 0; i < a.size(); ++i) {
            REQUIRE(std::abs(ms[t][i] - mp[t][i]) <= std::abs(ms[t][i]) * 0x1p-23f);
            REQUIRE(to_bf16(mp[t][i]) == b[i]);  // the weight is the master, rounded
          }
          elements += a.size();
        }
      }
      // No fp32 master tensor: its low halves (I16) instead, 2 bytes per parameter less.
      strata_tensor_t* low = nullptr;
      STRATA_REQUIRE_OK(
          strata_optimizer_get_state(po.get(), spl.weights[1][0], STRATA_STATE_MASTER_LOW, &low));
      strata_tensor_info_t info{};
      info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_tensor_get_info(spl.rt.get(), low, &info));
      REQUIRE(info.dtype == STRATA_DTYPE_I16);
      REQUIRE(info.nbytes == 2 * static_cast<uint64_t>(spl.sizes[0]));
      const auto sa = stats_of(so.get()), sb = stats_of(po.get());
      INFO("separate " << sa.state_bytes << " bytes, split " << sb.state_bytes);
      REQUIRE(sa.state_bytes - sb.state_bytes >= 2 * elements - 8 * 4096);
      REQUIRE(sa.state_bytes - sb.state_bytes <= 2 * elements + 8 * 4096);
    }
  }
}

TEST_CASE("grads homed in HBM train as grads in DRAM, in 2 bytes per parameter less",
          "[optimizer]") {
  struct Variant {
    const char* name;
    float max_grad_norm;
    int micro;
    bool explicit_updates;
    std::vector<int64_t> sizes = {3000, 1100};
  };
  for (const Variant& var :
       {Variant{"updates during the backward", 0.f, 1, false},
        Variant{"clipped: norms, then updates in forward order", 0.5f, 1, false},
        Variant{"three accumulated micro-steps", 0.f, 3, false},
        // Layers of several tasks: fetched slice by slice, lower layers preempting higher ones.
        Variant{"large layers, preempted", 0.f, 1, false, {300000, 70000}},
        Variant{"explicit updates", 0.f, 1, true},
        Variant{
            "explicit updates, three backward passes per step", 0.f, 3, true, {300000, 70000}}}) {
    DYNAMIC_SECTION(var.name) {
      strata_optimizer_config_t c = adamw_config();
      c.max_grad_norm = var.max_grad_norm;
      if (var.explicit_updates) {
        c.update_mode = STRATA_UPDATE_EXPLICIT;
      } else {
        c.accumulation_steps = static_cast<uint32_t>(var.micro);
      }
      Model dram = make_model(5, 42, backend_under_test(), var.sizes);
      Model hbm = make_model(5, 42, backend_under_test(), var.sizes, nullptr, STRATA_TIER_DRAM,
                             STRATA_TIER_HBM);
      OptimizerPtr d_opt = make_optimizer(dram, c, STRATA_MASTER_SPLIT);
      OptimizerPtr h_opt = make_optimizer(hbm, c, STRATA_MASTER_SPLIT);
      // Unattached, nothing could fetch the grads: a manual step is refused, not run on garbage.
      if (!var.explicit_updates) {
        REQUIRE(strata_optimizer_step(h_opt.get()) == STRATA_ERROR_INVALID_STATE);
        REQUIRE(std::string(strata_last_error_message()).find("HBM") != std::string::npos);
      }
      Streamed ds, hs;
      attach_streamed(dram, d_opt.get(), &ds);
      attach_streamed(hbm, h_opt.get(), &hs);
      for (auto [m, o, ex] : {std::tuple{&dram, d_opt.get(), ds.ex}, {&hbm, h_opt.get(), hs.ex}}) {
        if (var.explicit_updates) {
          run_explicit(*m, o, ex, 0, 4, var.micro);
        } else {
          run_streamed(*m, o, ex, 0, 4, var.micro);
        }
      }
      // (A bool: Catch would print every byte of a difference.)
      const bool same = snapshot(hbm, h_opt.get()) == snapshot(dram, d_opt.get());
      REQUIRE(same);
      if (var.max_grad_norm > 0) {
        REQUIRE(stats_of(h_opt.get()).last_grad_norm == stats_of(d_opt.get()).last_grad_norm);
      }
      if (var.explicit_updates) {
        // A held grad reads the same from either home, before and after accumulating.
        const auto n = static_cast<std::size_t>(var.sizes[1]);
        std::vector<float> a(n), b(n);
        for (int pass = 0; pass < 2; ++pass) {
          streamed_pass(dram, ds.ex, 9, pass);
          streamed_pass(hbm, hs.ex, 9, pass);
          STRATA_REQUIRE_OK(
              strata_optimizer_grad_read(d_opt.get(), dram.weights[3][1], a.data(), n));
          STRATA_REQUIRE_OK(
              strata_optimizer_grad_read(h_opt.get(), hbm.weights[3][1], b.data(), n));
          const bool same_grad = a == b;
          REQUIRE(same_grad);
          REQUIRE(std::any_of(a.begin(), a.end(), [](float x) { return x != 0.f; }));
        }
      }
      // The backward pass wrote the grads in their HBM homes: nothing was copied out of HBM.
      strata_executor_stats_t dx{}, hx{};
      dx.struct_size = hx.struct_size = STRATA_EXECUTOR_STATS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_executor_get_stats(ds.ex, &dx));
      STRATA_REQUIRE_OK(strata_executor_get_stats(hs.ex, &hx));
      REQUIRE(dx.bytes_out > 0);
      REQUIRE(hx.bytes_out == 0);
      // The optimizer's copies out of HBM count on the D2H link: every grad, every step (at
      // least three steps' worth: on CUDA a copy is counted by the completion thread, which may
      // come after the fence the update waited for).
      strata_link_stats_t link{};
      link.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_runtime_link_stats(hbm.rt.get(), STRATA_LINK_D2H, &link));
      REQUIRE(link.bytes >= 3 * 5 * 2 * static_cast<uint64_t>(var.sizes[0] + var.sizes[1]));
      // DRAM holds no grads: what they took, less the fetch buffer of one layer's grads.
      strata_tier_usage_t du{}, hu{};
      du.struct_size = hu.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_runtime_tier_usage(dram.rt.get(), STRATA_TIER_DRAM, &du));
      STRATA_REQUIRE_OK(strata_runtime_tier_usage(hbm.rt.get(), STRATA_TIER_DRAM, &hu));
      const uint64_t layer_grads = 2 * static_cast<uint64_t>(var.sizes[0] + var.sizes[1]);
      const uint64_t all_grads = 5 * layer_grads;
      INFO("DRAM used: grads in DRAM " << du.used_bytes << ", in HBM " << hu.used_bytes);
      // (Each tensor in DRAM is rounded up to 4 KiB: ten grads and the buffer.)
      const auto saved = static_cast<int64_t>(du.used_bytes) - static_cast<int64_t>(hu.used_bytes);
      const auto expected = static_cast<int64_t>(all_grads - layer_grads);
      REQUIRE(saved > 0);
      REQUIRE(std::abs(saved - expected) <= 11 * 4096);
    }
  }
}

TEST_CASE("master_read and master_write, in every layout", "[optimizer]") {
  Model m = make_model(2, 3, STRATA_DEVICE_BACKEND_HOST);
  strata_tensor_t* f32w = register_tensor(m.rt.get(), "f32.w", 500, STRATA_DTYPE_F32,
                                          STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
  strata_tensor_t* f32g = register_tensor(m.rt.get(), "f32.g", 500, STRATA_DTYPE_F32,
                                          STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
  strata_tensor_t* f16w = register_tensor(m.rt.get(), "f16.w", 500, STRATA_DTYPE_F16,
                                          STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
  strata_tensor_t* f16g = register_tensor(m.rt.get(), "f16.g", 500, STRATA_DTYPE_F16,
                                          STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
  strata_optimizer_config_t c = adamw_config();
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  strata_param_desc_t p{
      STRATA_PARAM_DESC_STRUCT_SIZE, m.weights[0][0], m.grads[0][0], 0, STRATA_MASTER_SPLIT,
      STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  p = {STRATA_PARAM_DESC_STRUCT_SIZE, m.weights[0][1], m.grads[0][1], 0, STRATA_MASTER_SEPARATE,
       STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  p = {STRATA_PARAM_DESC_STRUCT_SIZE, f32w, f32g, 0, STRATA_MASTER_SPLIT,
       STRATA_GRAD_SUM_ACCUMULATOR};  // its own master
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  p = {STRATA_PARAM_DESC_STRUCT_SIZE, f16w, f16g, 0, STRATA_MASTER_SPLIT,
       STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "f16: a split master needs a bf16 weight");
  p.master_layout = 7;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(o, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "unknown master_layout 7");
  // A 1.0/1.1-sized desc (no master_layout) is SEPARATE.
  p = {offsetof(strata_param_desc_t, master_layout), m.weights[1][0], m.grads[1][0], 0, 1, 1};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  strata_tensor_t* master = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_get_state(o, m.weights[1][0], STRATA_STATE_MASTER, &master));
  STRATA_REQUIRE_ERROR(
      strata_optimizer_get_state(o, m.weights[1][0], STRATA_STATE_MASTER_LOW, &master),
      STRATA_ERROR_NOT_FOUND, "no such state");
  STRATA_REQUIRE_ERROR(strata_optimizer_get_state(o, m.weights[0][0], STRATA_STATE_MASTER, &master),
                       STRATA_ERROR_NOT_FOUND, "master is split");
  REQUIRE(strata_optimizer_get_state(o, m.weights[0][0], 5, &master) ==
          STRATA_ERROR_INVALID_ARGUMENT);

  // Values a bf16 weight cannot hold, a halfway one among them.
  for (auto [w, n] : {std::pair{m.weights[0][0], 3000}, {m.weights[0][1], 1100}, {f32w, 500}}) {
    INFO(n << " elements");
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>(i) + 1e-7f;
    v[1] = std::bit_cast<float>(0x3F808000u);  // halfway: rounds down to even 0x3F80
    STRATA_REQUIRE_OK(strata_optimizer_master_write(o, w, v.data(), v.size()));
    std::vector<float> back(v.size());
    STRATA_REQUIRE_OK(strata_optimizer_master_read(o, w, back.data(), back.size()));
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (w == m.weights[0][0] && i == 1) {
        REQUIRE(std::bit_cast<uint32_t>(back[i]) == 0x3F807FFFu);  // one ulp nearer the weight
      } else {
        REQUIRE(back[i] == v[i]);
      }
    }
    if (w != f32w) {
      // The working copy is the master rounded, as torch's .to(torch.bfloat16).
      const auto bits = read_bf16(m.rt.get(), w, n);
      for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(bits[i] == to_bf16(v[i]));
    }
    REQUIRE(strata_optimizer_master_read(o, w, back.data(), back.size() - 1) ==
            STRATA_ERROR_INVALID_ARGUMENT);
    STRATA_REQUIRE_ERROR(strata_optimizer_master_write(o, w, v.data(), v.size() + 1),
                         STRATA_ERROR_INVALID_ARGUMENT, "count is");
  }
  // A split weight written alone: the master moves with it, and a stale rest never makes it a
  // NaN (weight 0 under the rest -1 of 0x3F7FFFFF wrapped to 0xFFFFFFFF).
  {
    strata_tensor_t* w = m.weights[0][0];
    std::vector<float> v(3000, std::bit_cast<float>(0x3F7FFFFFu));  // weight 0x3F80, rest -1
    STRATA_REQUIRE_OK(strata_optimizer_master_write(o, w, v.data(), v.size()));
    std::vector<uint16_t> zeros(3000, 0);
    STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), w, 0, zeros.data(), zeros.size() * 2));
    STRATA_REQUIRE_OK(strata_optimizer_master_read(o, w, v.data(), v.size()));
    REQUIRE(v[0] == 0.f);
  }
  float x = 0;
  STRATA_REQUIRE_ERROR(strata_optimizer_master_read(o, m.weights[1][1], &x, 1),
                       STRATA_ERROR_NOT_FOUND, "not a parameter");
  REQUIRE(strata_optimizer_master_read(o, m.weights[0][0], nullptr, 3000) ==
          STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_optimizer_master_write(nullptr, m.weights[0][0], &x, 1) ==
          STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_optimizer_master_read(o, nullptr, &x, 1) == STRATA_ERROR_INVALID_ARGUMENT);
}

// torch's AdamW reads each param group's betas and eps at every step (OneCycleLR cycles beta1),
// bias corrections from the current betas: two fp32 params in two groups whose betas, eps, lr
// and weight decay change at every step follow the formula step by step.
TEST_CASE("each group's betas and eps are read at every update, as torch's AdamW does",
          "[optimizer]") {
  Model m = make_model(1, 3, STRATA_DEVICE_BACKEND_HOST, {});
  constexpr int64_t n = 257;
  strata_tensor_t* w[2];
  strata_tensor_t* g[2];
  strata_optimizer_config_t c = adamw_config();
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  std::vector<double> ref_p[2], ref_m[2], ref_v[2];
  for (int k = 0; k < 2; ++k) {
    w[k] = register_tensor(m.rt.get(), "w" + std::to_string(k), n, STRATA_DTYPE_F32,
                           STRATA_ROLE_WEIGHT);
    g[k] =
        register_tensor(m.rt.get(), "g" + std::to_string(k), n, STRATA_DTYPE_F32, STRATA_ROLE_GRAD);
    std::vector<float> init(n);
    for (int64_t i = 0; i < n; ++i) init[i] = 0.5f - 0.003f * static_cast<float>(i) * (k + 1);
    STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), w[k], 0, init.data(), n * 4));
    ref_p[k].assign(init.begin(), init.end());
    ref_m[k].assign(n, 0.0);
    ref_v[k].assign(n, 0.0);
    strata_param_desc_t p{
        STRATA_PARAM_DESC_STRUCT_SIZE, w[k], g[k], static_cast<uint32_t>(k), STRATA_MASTER_SEPARATE,
        STRATA_GRAD_SUM_ACCUMULATOR};
    STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
  }
  // A group not created yet reads as group 0, the config's values.
  strata_group_hyperparams_t h{};
  h.struct_size = STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_get_group(o, 9, &h));
  REQUIRE(h.lr == c.lr);
  REQUIRE(h.beta1 == c.beta1);
  REQUIRE(h.beta2 == c.beta2);
  REQUIRE(h.eps == c.eps);
  for (int t = 1; t <= 5; ++t) {
    for (int k = 0; k < 2; ++k) {
      h.lr = 1e-2f / static_cast<float>(t + k);
      h.weight_decay = k == 0 ? 0.1f : 0.f;
      h.beta1 = 0.95f - 0.02f * static_cast<float>(t) - 0.1f * static_cast<float>(k);
      h.beta2 = 0.999f - 0.01f * static_cast<float>(t % 3);
      h.eps = k == 0 ? 1e-8f : 1e-3f * static_cast<float>(t);
      STRATA_REQUIRE_OK(strata_optimizer_set_group_hyperparams(o, static_cast<uint32_t>(k), &h));
      strata_group_hyperparams_t back{};
      back.struct_size = STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_optimizer_get_group(o, static_cast<uint32_t>(k), &back));
      REQUIRE(back.beta1 == h.beta1);
      REQUIRE(back.eps == h.eps);
      std::vector<float> grad(n);
      for (int64_t i = 0; i < n; ++i) {
        grad[i] = std::sin(0.37f * static_cast<float>(i + 11 * t + 5 * k));
      }
      STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), g[k], 0, grad.data(), n * 4));
      const double b1 = h.beta1, b2 = h.beta2;
      const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
      for (int64_t i = 0; i < n; ++i) {
        double& p = ref_p[k][i];
        p *= 1 - double{h.lr} * h.weight_decay;
        ref_m[k][i] = b1 * ref_m[k][i] + (1 - b1) * grad[i];
        ref_v[k][i] = b2 * ref_v[k][i] + (1 - b2) * double{grad[i]} * grad[i];
        p -= h.lr / bc1 * ref_m[k][i] / (std::sqrt(ref_v[k][i]) / std::sqrt(bc2) + h.eps);
      }
    }
    STRATA_REQUIRE_OK(strata_optimizer_step(o));
    for (int k = 0; k < 2; ++k) {
      std::vector<float> got(n);
      STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), w[k], 0, got.data(), n * 4));
      for (int64_t i = 0; i < n; ++i) {
        INFO("step " << t << " group " << k << " element " << i);
        REQUIRE(std::abs(got[i] - ref_p[k][i]) <= 2e-6 * std::max(1.0, std::abs(ref_p[k][i])));
      }
    }
  }
  // The 1.0 setter changes lr and weight decay only: the betas set above stay.
  STRATA_REQUIRE_OK(strata_optimizer_set_group(o, 1, 1e-3f, 0.f));
  strata_group_hyperparams_t kept{};
  kept.struct_size = STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_get_group(o, 1, &kept));
  REQUIRE(kept.lr == 1e-3f);
  REQUIRE(kept.beta1 == h.beta1);
  REQUIRE(kept.eps == h.eps);
}

TEST_CASE("group hyperparameters are checked as the config's are", "[optimizer]") {
  Model m = make_model(1, 3, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t c = adamw_config();
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  strata_group_hyperparams_t h{};
  h.struct_size = STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_get_group(o, 0, &h));
  const strata_group_hyperparams_t good = h;
  auto refused = [&](strata_group_hyperparams_t bad, const char* what) {
    STRATA_REQUIRE_ERROR(strata_optimizer_set_group_hyperparams(o, 2, &bad),
                         STRATA_ERROR_INVALID_ARGUMENT, what);
    // Nothing changed: group 2 still reads as group 0.
    strata_group_hyperparams_t now{};
    now.struct_size = STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_optimizer_get_group(o, 2, &now));
    REQUIRE(now.beta1 == good.beta1);
    REQUIRE(now.lr == good.lr);
  };
  h.beta1 = 1.f;
  refused(h, "beta1");
  h = good;
  h.beta2 = -0.1f;
  refused(h, "beta2");
  h = good;
  h.eps = 0.f;
  refused(h, "eps");
  h = good;
  h.lr = NAN;
  refused(h, "lr");
  h = good;
  h.weight_decay = INFINITY;
  refused(h, "weight_decay");
  h = good;
  h.struct_size = offsetof(strata_group_hyperparams_t, eps);
  refused(h, "struct_size");
  STRATA_REQUIRE_ERROR(strata_optimizer_set_group_hyperparams(o, 65536, &good),
                       STRATA_ERROR_INVALID_ARGUMENT, "65536");
  h = good;
  STRATA_REQUIRE_ERROR(strata_optimizer_get_group(o, 65536, &h), STRATA_ERROR_INVALID_ARGUMENT,
                       "65536");
  REQUIRE(strata_optimizer_set_group_hyperparams(o, 0, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_optimizer_set_group_hyperparams(nullptr, 0, &good) ==
          STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_optimizer_get_group(o, 0, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(strata_optimizer_get_group(nullptr, 0, &h) == STRATA_ERROR_INVALID_ARGUMENT);
  h.struct_size = 8;
  REQUIRE(strata_optimizer_get_group(o, 0, &h) == STRATA_ERROR_INVALID_ARGUMENT);
  // A larger struct from a newer header: the library writes only the fields it knows.
  struct Newer {
    strata_group_hyperparams_t h;
    float later;
  } newer{};
  newer.h.struct_size = sizeof newer;
  newer.later = 42.f;
  STRATA_REQUIRE_OK(strata_optimizer_get_group(o, 0, &newer.h));
  REQUIRE(newer.later == 42.f);
  REQUIRE(newer.h.struct_size == sizeof newer);
  STRATA_REQUIRE_OK(strata_optimizer_set_group_hyperparams(o, 3, &newer.h));
}

TEST_CASE("master_read and master_write refuse inside an executor step", "[optimizer]") {
  Model m = make_model(2, 5, backend_under_test());
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  OptimizerPtr opt = make_optimizer(m, c, STRATA_MASTER_SPLIT);
  Streamed st;
  attach_streamed(m, opt.get(), &st);
  std::vector<float> v(3000, 0.5f);
  STRATA_REQUIRE_OK(strata_step_begin(st.ex));
  STRATA_REQUIRE_ERROR(strata_optimizer_master_write(opt.get(), m.weights[0][0], v.data(), 3000),
                       STRATA_ERROR_INVALID_STATE, "inside an executor step");
  STRATA_REQUIRE_ERROR(strata_optimizer_master_read(opt.get(), m.weights[0][0], v.data(), 3000),
                       STRATA_ERROR_INVALID_STATE, "inside an executor step");
  STRATA_REQUIRE_OK(strata_step_abort(st.ex, nullptr));
  STRATA_REQUIRE_OK(strata_optimizer_master_write(opt.get(), m.weights[0][0], v.data(), 3000));
  // The next forward pass streams the written value.
  run_explicit(m, opt.get(), st.ex, 0, 1, 1);
  std::vector<float> after(3000);
  STRATA_REQUIRE_OK(strata_optimizer_master_read(opt.get(), m.weights[0][0], after.data(), 3000));
  REQUIRE(std::abs(after[0] - 0.5f) < 0.05f);
  REQUIRE(after[0] != 0.5f);  // and one update moved it
}

TEST_CASE("master_read beside manual steps on another thread sees whole steps only",
          "[optimizer]") {
  // Constant grads: the masters after k steps are the same in every run. A read from another
  // thread while steps run must see one of those states, never a step half done (the access
  // and a manual step's kernels are serialized; TSan checks the memory too). Many short steps
  // and reads in a tight loop: a step starting between a read's wait and its access would be
  // caught here.
  Model a = make_model(1, 4, STRATA_DEVICE_BACKEND_HOST, {20000, 700});
  Model b = make_model(1, 4, STRATA_DEVICE_BACKEND_HOST, {20000, 700});
  OptimizerPtr ao = make_optimizer(a, adamw_config(), STRATA_MASTER_SPLIT);
  OptimizerPtr bo = make_optimizer(b, adamw_config(), STRATA_MASTER_SPLIT);
  for (Model* m : {&a, &b}) {
    for (std::size_t k = 0; k < m->weights[0].size(); ++k) {
      const auto w = read_bf16(m->rt.get(), m->weights[0][k], m->sizes[k]);
      const auto g = grads_for(w, 0, 0, 0);
      STRATA_REQUIRE_OK(
          strata_tensor_write(m->rt.get(), m->grads[0][k], 0, g.data(), g.size() * 2));
    }
  }
  const int steps = 400;
  auto master = [](Model& m, strata_optimizer_t* o) {
    std::vector<float> v(static_cast<std::size_t>(m.sizes[0]));
    STRATA_REQUIRE_OK(strata_optimizer_master_read(o, m.weights[0][0], v.data(), v.size()));
    return v;
  };
  std::vector<std::vector<float>> states{master(a, ao.get())};
  for (int i = 0; i < steps; ++i) {
    STRATA_REQUIRE_OK(strata_optimizer_step(ao.get()));
    states.push_back(master(a, ao.get()));
  }
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  std::thread stepper([&] {
    for (int i = 0; i < steps; ++i) failures += strata_optimizer_step(bo.get()) != STRATA_OK;
    done = true;
  });
  int whole = 0, reads = 0;
  std::vector<float> v(static_cast<std::size_t>(b.sizes[0]));
  std::size_t last = 0;  // states only move forward
  while (!done) {
    ++reads;
    if (strata_optimizer_master_read(bo.get(), b.weights[0][0], v.data(), v.size()) != STRATA_OK) {
      ++failures;
      continue;
    }
    const auto at = std::find(states.begin() + static_cast<std::ptrdiff_t>(last), states.end(), v);
    if (at != states.end()) {
      ++whole;
      last = static_cast<std::size_t>(at - states.begin());
    }
  }
  stepper.join();
  INFO(reads << " reads");
  REQUIRE(failures == 0);
  REQUIRE(whole == reads);
  REQUIRE(master(b, bo.get()) == states.back());
}
