// The optimizer and checkpoints through the C ABI, on the backend under test: updates driven by
// the executor's steps equal the same updates run by hand (so each layer's update lands before
// its next load, and grads are whole when read); clipping, loss scaling, accumulation; misuse;
// checkpoints round-trip, resume bit for bit, detect corruption, survive SIGKILL mid-save.
#define CATCH_CONFIG_RUNNER
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>

#include "optimizer/optimizer_model.h"
#include "support/device_views.h"

using namespace strata_test;

TEST_CASE("updates driven by the executor equal the same updates run by hand", "[optimizer]") {
  struct Variant {
    const char* name;
    float max_grad_norm;
    uint32_t accumulation;
    uint64_t slot_budget;
    std::vector<int64_t> sizes = {3000, 1100};
  };
  for (const Variant& var : {Variant{"per layer, overlapped with backward", 0.f, 1, 0},
                             Variant{"two slots", 0.f, 1, 2 * 4 * 4100 * 2},
                             Variant{"clipped: deferred to the next forward", 0.5f, 1, 0},
                             Variant{"three accumulated micro-steps", 0.f, 3, 0},
                             // Layers of several tasks: lower layers preempt higher ones.
                             Variant{"large layers, preempted", 0.f, 1, 0, {300000, 70000}},
                             Variant{"large layers, accumulated", 0.f, 2, 0, {300000, 70000}}}) {
    DYNAMIC_SECTION(var.name) {
      strata_optimizer_config_t c = adamw_config();
      c.max_grad_norm = var.max_grad_norm;
      c.accumulation_steps = var.accumulation;
      Model streamed = make_model(5, 42, backend_under_test(), var.sizes);
      Model manual = make_model(5, 42, STRATA_DEVICE_BACKEND_HOST, var.sizes);
      OptimizerPtr so = make_optimizer(streamed, c);
      OptimizerPtr mo = make_optimizer(manual, c);
      Streamed st;
      make_streamed(streamed, &st, var.slot_budget);
      STRATA_REQUIRE_OK(strata_optimizer_attach(so.get(), st.ex));
      run_streamed(streamed, so.get(), st.ex, 0, 6, static_cast<int>(var.accumulation));
      run_manual(manual, mo.get(), 0, 6, static_cast<int>(var.accumulation));
      const auto a = snapshot(streamed, so.get());
      const auto b = snapshot(manual, mo.get());
      if (var.max_grad_norm > 0) {
        // The global norm sums the layers in another order: equal to float rounding.
        REQUIRE(max_relative_difference(a, b) < 1e-5f);
      } else {
        REQUIRE(a == b);
      }
      const strata_optimizer_stats_t s = stats_of(so.get());
      REQUIRE(s.step == 6);
      REQUIRE(s.params == 10);
      REQUIRE(s.micro_step == 0);
      if (var.max_grad_norm > 0) REQUIRE(s.last_grad_norm > 0);
      // Detach by destroying the optimizer between steps; the executor runs on without it.
      STRATA_REQUIRE_OK(strata_optimizer_destroy(so.release()));
      STRATA_REQUIRE_OK(strata_step_begin(st.ex));
    }
  }
}

TEST_CASE("clipping scales by max_norm / (norm + 1e-6), as clip_grad_norm_", "[optimizer]") {
  // SGD without momentum makes the applied grad visible: w1 = w0 - lr * coef * g.
  Model m = make_model(1, 1, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t c;
  strata_optimizer_config_init(STRATA_OPTIMIZER_SGD, &c);
  c.lr = 1.f;
  c.max_grad_norm = 1.f;
  c.threads = 2;
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  // fp32 weight (its own master) and fp32 grad.
  strata_tensor_t* w =
      register_tensor(m.rt.get(), "w32", 1000, STRATA_DTYPE_F32, STRATA_ROLE_WEIGHT);
  strata_tensor_t* g = register_tensor(m.rt.get(), "g32", 1000, STRATA_DTYPE_F32, STRATA_ROLE_GRAD);
  std::vector<float> w0(1000, 1.f), g0(1000);
  double sq = 0;
  for (std::size_t i = 0; i < g0.size(); ++i) {
    g0[i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
    sq += double{g0[i]} * g0[i];
  }
  STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), w, 0, w0.data(), 4000));
  STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), g, 0, g0.data(), 4000));
  strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, STRATA_MASTER_SEPARATE,
                        STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
  strata_tensor_t* master = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, STRATA_STATE_MASTER, &master));
  REQUIRE(master == w);  // an fp32 weight is its own master
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  const double norm = std::sqrt(sq);
  const double coef = std::min(1.0, 1.0 / (norm + 1e-6));
  REQUIRE(norm > 1.0);  // so the clip acts
  std::vector<float> w1(1000);
  STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), w, 0, w1.data(), 4000));
  for (std::size_t i = 0; i < w1.size(); ++i) {
    REQUIRE(std::abs(w1[i] - (1.0 - coef * g0[i])) <= 1e-6);
  }
  const strata_optimizer_stats_t s = stats_of(opt.get());
  REQUIRE(std::abs(s.last_grad_norm - norm) <= 1e-6 * norm);
}

TEST_CASE("Adam, Lion and Adagrad through the C ABI: defaults, state, updates", "[optimizer]") {
  // Since 1.4. An fp32 weight (its own master), two steps with the same grad, against the
  // formulas in double (the kernels' own test covers every layout and ISA).
  for (strata_optimizer_kind_t kind :
       {STRATA_OPTIMIZER_ADAM, STRATA_OPTIMIZER_LION, STRATA_OPTIMIZER_ADAGRAD}) {
    CAPTURE(kind);
    Model m = make_model(1, 1, STRATA_DEVICE_BACKEND_HOST);
    strata_optimizer_config_t c;
    STRATA_REQUIRE_OK(strata_optimizer_config_init(kind, &c));
    // The defaults: torch.optim.Adam's and Adagrad's, lion-pytorch's.
    REQUIRE(c.weight_decay == 0.f);
    REQUIRE(c.lr == (kind == STRATA_OPTIMIZER_LION      ? 1e-4f
                     : kind == STRATA_OPTIMIZER_ADAGRAD ? 1e-2f
                                                        : 1e-3f));
    REQUIRE(c.beta2 == (kind == STRATA_OPTIMIZER_LION ? 0.99f : 0.999f));
    REQUIRE(c.eps == (kind == STRATA_OPTIMIZER_ADAGRAD ? 1e-10f : 1e-8f));
    c.lr = 0.01f;
    c.weight_decay = 0.1f;
    c.threads = 1;
    strata_optimizer_t* o = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
    OptimizerPtr opt(o);
    const std::size_t n = 1000;
    strata_tensor_t* w = register_tensor(m.rt.get(), "w", n, STRATA_DTYPE_F32, STRATA_ROLE_WEIGHT);
    strata_tensor_t* g = register_tensor(m.rt.get(), "g", n, STRATA_DTYPE_F32, STRATA_ROLE_GRAD);
    std::vector<float> w0(n), g0(n);
    for (std::size_t i = 0; i < n; ++i) {
      w0[i] = 0.5f - 0.001f * static_cast<float>(i);
      g0[i] = 0.01f * static_cast<float>(i % 17) - 0.08f;  // zeros among them (i % 17 == 8)
    }
    STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), w, 0, w0.data(), 4 * n));
    STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), g, 0, g0.data(), 4 * n));
    strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, STRATA_MASTER_SEPARATE,
                          STRATA_GRAD_SUM_ACCUMULATOR};
    STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
    // The state each kind keeps, and none other.
    strata_tensor_t* avg = nullptr;
    strata_tensor_t* sq = nullptr;
    const bool has_avg = kind != STRATA_OPTIMIZER_ADAGRAD, has_sq = kind != STRATA_OPTIMIZER_LION;
    REQUIRE((strata_optimizer_get_state(opt.get(), w, STRATA_STATE_EXP_AVG, &avg) == STRATA_OK) ==
            has_avg);
    REQUIRE((strata_optimizer_get_state(opt.get(), w, STRATA_STATE_EXP_AVG_SQ, &sq) == STRATA_OK) ==
            has_sq);
    REQUIRE(stats_of(opt.get()).state_bytes >= 4 * n * ((has_avg ? 1 : 0) + (has_sq ? 1 : 0)));
    const double init = kind == STRATA_OPTIMIZER_ADAGRAD ? 0.1 : 0.0;
    if (kind == STRATA_OPTIMIZER_ADAGRAD) {  // initial_accumulator_value, written as documented
      const std::vector<float> start(n, static_cast<float>(init));
      STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), sq, 0, start.data(), 4 * n));
    }
    std::vector<double> rp(w0.begin(), w0.end()), rm(n, 0), rv(n, init);
    const double lr = c.lr, wd = c.weight_decay, b1 = c.beta1, b2 = c.beta2, eps = c.eps;
    for (int t = 1; t <= 2; ++t) {
      STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
      for (std::size_t i = 0; i < n; ++i) {
        const double gi = g0[i];
        if (kind == STRATA_OPTIMIZER_ADAM) {
          const double d = gi + wd * rp[i];
          rm[i] = b1 * rm[i] + (1 - b1) * d;
          rv[i] = b2 * rv[i] + (1 - b2) * d * d;
          const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
          rp[i] -= lr / bc1 * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + eps);
        } else if (kind == STRATA_OPTIMIZER_LION) {
          const double u = b1 * rm[i] + (1 - b1) * gi;
          rp[i] = rp[i] * (1 - lr * wd) - lr * ((u > 0) - (u < 0));
          rm[i] = b2 * rm[i] + (1 - b2) * gi;
        } else {
          const double d = gi + wd * rp[i];
          rv[i] += d * d;
          rp[i] -= lr * d / (std::sqrt(rv[i]) + eps);
        }
      }
    }
    std::vector<float> w2(n);
    STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), w, 0, w2.data(), 4 * n));
    for (std::size_t i = 0; i < n; ++i) {
      INFO("element " << i);
      REQUIRE(std::abs(w2[i] - rp[i]) <= 1e-6 * std::max(1.0, std::abs(rp[i])));
    }
  }
}

TEST_CASE("dynamic loss scaling skips overflowed steps and backs off", "[optimizer]") {
  Model m = make_model(1, 2, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t c = adamw_config();
  c.loss_scale = 1024.f;
  c.dynamic_loss_scale = 1;
  c.growth_interval = 2;
  OptimizerPtr opt = make_optimizer(m, c);
  const auto before = snapshot(m, opt.get());
  std::vector<uint16_t> g(3000, to_bf16(1.f));
  g[5] = 0x7F80;  // +inf in bf16
  STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), m.grads[0][0], 0, g.data(), g.size() * 2));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  strata_optimizer_stats_t s = stats_of(opt.get());
  REQUIRE(s.skipped_steps == 1);
  REQUIRE(s.step == 0);
  REQUIRE(s.loss_scale == 512.f);
  REQUIRE(snapshot(m, opt.get()) == before);  // nothing changed
  g[5] = to_bf16(1.f);
  STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), m.grads[0][0], 0, g.data(), g.size() * 2));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  s = stats_of(opt.get());
  REQUIRE(s.step == 2);
  REQUIRE(s.loss_scale == 1024.f);  // grown after growth_interval good steps
  REQUIRE(snapshot(m, opt.get()) != before);
}

TEST_CASE("steps from two threads are serialized", "[optimizer]") {
  // Constant grads: ten steps give the same state however they interleave, if each runs whole.
  Model a = make_model(2, 4, STRATA_DEVICE_BACKEND_HOST, {300000, 70000});
  Model b = make_model(2, 4, STRATA_DEVICE_BACKEND_HOST, {300000, 70000});
  OptimizerPtr ao = make_optimizer(a, adamw_config());
  OptimizerPtr bo = make_optimizer(b, adamw_config());
  for (Model* m : {&a, &b}) {
    for (std::size_t l = 0; l < m->weights.size(); ++l) {
      for (std::size_t k = 0; k < m->weights[l].size(); ++k) {
        const auto w = read_bf16(m->rt.get(), m->weights[l][k], m->sizes[k]);
        const auto g = grads_for(w, 0, static_cast<int>(l), 0);
        STRATA_REQUIRE_OK(
            strata_tensor_write(m->rt.get(), m->grads[l][k], 0, g.data(), g.size() * 2));
      }
    }
  }
  for (int i = 0; i < 10; ++i) STRATA_REQUIRE_OK(strata_optimizer_step(ao.get()));
  std::atomic<int> failures{0};
  auto five = [&] {
    for (int i = 0; i < 5; ++i) failures += strata_optimizer_step(bo.get()) != STRATA_OK;
  };
  std::thread t1(five), t2(five);
  t1.join();
  t2.join();
  REQUIRE(failures == 0);
  REQUIRE(snapshot(b, bo.get()) == snapshot(a, ao.get()));
}

TEST_CASE("optimizer misuse gets clear errors", "[optimizer]") {
  Model m = make_model(2, 3, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t c = adamw_config();
  strata_optimizer_t* o = nullptr;
  c.beta1 = 1.5f;
  STRATA_REQUIRE_ERROR(strata_optimizer_create(m.rt.get(), &c, &o), STRATA_ERROR_INVALID_ARGUMENT,
                       "beta1");
  c = adamw_config();
  c.lr = NAN;
  STRATA_REQUIRE_ERROR(strata_optimizer_create(m.rt.get(), &c, &o), STRATA_ERROR_INVALID_ARGUMENT,
                       "lr");
  STRATA_REQUIRE_ERROR(strata_optimizer_config_init(7, &c), STRATA_ERROR_INVALID_ARGUMENT, "kind");
  c = adamw_config();
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
  OptimizerPtr opt(o);
  STRATA_REQUIRE_ERROR(strata_optimizer_step(opt.get()), STRATA_ERROR_INVALID_STATE, "no params");
  strata_param_desc_t p{
      STRATA_PARAM_DESC_STRUCT_SIZE, m.weights[0][0], m.weights[0][0], 0, STRATA_MASTER_SEPARATE,
      STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(opt.get(), &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "its own grad");
  p.grad = m.grads[0][1];  // 1100 elements for 3000
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(opt.get(), &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "elements");
  strata_tensor_t* bytes = register_bytes(m.rt.get(), "u8", 6000, STRATA_TIER_DRAM);
  p.grad = bytes;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(opt.get(), &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "u8");
  p.grad = m.grads[0][0];
  p.struct_size = 4;
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(opt.get(), &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "struct_size");
  p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(opt.get(), &p), STRATA_ERROR_ALREADY_EXISTS,
                       "already belongs");
  // The weight is pinned while the optimizer lives.
  STRATA_REQUIRE_ERROR(strata_tensor_unregister(m.rt.get(), m.weights[0][0]), STRATA_ERROR_BUSY,
                       "optimizer");
  strata_tensor_t* state = nullptr;
  STRATA_REQUIRE_ERROR(
      strata_optimizer_get_state(opt.get(), m.weights[1][0], STRATA_STATE_MASTER, &state),
      STRATA_ERROR_NOT_FOUND, "not a parameter");
  STRATA_REQUIRE_ERROR(strata_optimizer_set_group(opt.get(), 0, -1.f, 0.f),
                       STRATA_ERROR_INVALID_ARGUMENT, "lr");
  // A graph without layer 0's weight param: attach names the stray weight.
  Streamed st;
  STRATA_REQUIRE_OK(strata_graph_create(m.rt.get(), &st.graph));
  strata_layer_desc_t d{};
  d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
  d.weights = m.weights[1].data();
  d.weight_count = 2;
  STRATA_REQUIRE_OK(strata_graph_add_layer(st.graph, &d, nullptr));
  STRATA_REQUIRE_OK(strata_plan_create(st.graph, nullptr, &st.plan));
  STRATA_REQUIRE_OK(strata_executor_create(st.plan, &st.ex));
  STRATA_REQUIRE_ERROR(strata_optimizer_attach(opt.get(), st.ex), STRATA_ERROR_INVALID_ARGUMENT,
                       "layers.0.w0");
  // The optimizer's state counts against the DRAM budget: too big a weight fails cleanly.
  Model tiny;
  tiny.rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 8 * kMiB, 8 * kMiB));
  strata_tensor_t* big =
      register_tensor(tiny.rt.get(), "big", 1 << 20, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT);
  strata_tensor_t* bigg =
      register_tensor(tiny.rt.get(), "big.grad", 1 << 20, STRATA_DTYPE_BF16, STRATA_ROLE_GRAD);
  strata_optimizer_t* to = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(tiny.rt.get(), &c, &to));
  OptimizerPtr topt(to);
  strata_param_desc_t bp{STRATA_PARAM_DESC_STRUCT_SIZE, big, bigg, 0, STRATA_MASTER_SEPARATE,
                         STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_ERROR(strata_optimizer_add_param(topt.get(), &bp), STRATA_ERROR_OUT_OF_MEMORY,
                       "big");
  strata_tier_usage_t u{};
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(tiny.rt.get(), STRATA_TIER_DRAM, &u));
  REQUIRE(u.tensor_count == 2);  // nothing of the failed param left behind
  STRATA_REQUIRE_OK(strata_tensor_unregister(tiny.rt.get(), big));  // and not pinned
}

// ------------------------------------------------------------------------------------------
// Checkpoints

TEST_CASE("explicit updates: the framework's loop, any accumulation, equals updates by hand",
          "[optimizer]") {
  for (int micro : {1, 3}) {
    DYNAMIC_SECTION(micro << " backward passes per step") {
      for (std::vector<int64_t> sizes :
           {std::vector<int64_t>{3000, 1100}, std::vector<int64_t>{300000, 70000}}) {
        strata_optimizer_config_t manual_config = adamw_config();
        manual_config.accumulation_steps = static_cast<uint32_t>(micro);
        strata_optimizer_config_t c = adamw_config();
        c.update_mode = STRATA_UPDATE_EXPLICIT;
        Model streamed = make_model(5, 42, backend_under_test(), sizes);
        Model manual = make_model(5, 42, STRATA_DEVICE_BACKEND_HOST, sizes);
        OptimizerPtr so = make_optimizer(streamed, c);
        OptimizerPtr mo = make_optimizer(manual, manual_config);
        Streamed st;
        make_streamed(streamed, &st, 0);
        STRATA_REQUIRE_OK(strata_optimizer_attach(so.get(), st.ex));
        run_explicit(streamed, so.get(), st.ex, 0, 4, micro);
        run_manual(manual, mo.get(), 0, 4, micro);
        // (g1 + g2) + g3 either way: bit for bit.
        REQUIRE(snapshot(streamed, so.get()) == snapshot(manual, mo.get()));
        strata_grad_info_t info{};
        info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
        STRATA_REQUIRE_OK(strata_optimizer_grad_info(so.get(), streamed.weights[0][0], &info));
        REQUIRE(info.has_grad == 0);
        REQUIRE(info.step == 4);
      }
    }
  }
}

TEST_CASE("explicit updates: held grads read, measured, scaled and zeroed as torch's p.grad",
          "[optimizer]") {
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  Model m = make_model(3, 7, backend_under_test());
  OptimizerPtr opt = make_optimizer(m, c);
  Streamed st;
  make_streamed(m, &st, 0);
  STRATA_REQUIRE_OK(strata_optimizer_attach(opt.get(), st.ex));
  strata_tensor_t* w = m.weights[1][0];
  const auto n = static_cast<std::size_t>(m.sizes[0]);
  const auto weights = read_bf16(m.rt.get(), w, m.sizes[0]);
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
  REQUIRE(info.has_grad == 0);  // nothing computed yet: None
  std::vector<float> got(n);
  REQUIRE(strata_optimizer_grad_read(opt.get(), w, got.data(), n) == STRATA_ERROR_INVALID_STATE);

  streamed_pass(m, st.ex, 0, 0);
  const auto g1 = grads_for(weights, 0, 1, 0);
  STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
  double squares = 0;
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(got[i] == from_bf16(g1[i]));
    squares += double{got[i]} * got[i];
  }
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
  REQUIRE(info.has_grad == 1);
  REQUIRE(info.sum_squares == Approx(squares).epsilon(1e-6));
  REQUIRE(strata_optimizer_grad_read(opt.get(), w, got.data(), n - 1) ==
          STRATA_ERROR_INVALID_ARGUMENT);

  // A second backward pass without zeroing sums in fp32; a scale applies to what was held.
  STRATA_REQUIRE_OK(strata_optimizer_grad_scale(opt.get(), w, 0.5f));
  streamed_pass(m, st.ex, 0, 1);
  const auto g2 = grads_for(weights, 0, 1, 1);
  STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
  squares = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float want = from_bf16(g1[i]) * 0.5f + from_bf16(g2[i]);
    REQUIRE(got[i] == want);
    squares += double{want} * want;
  }
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
  REQUIRE(info.sum_squares == Approx(squares).epsilon(1e-6));

  // Zeroed to zeros: a step updates with a zero grad (decay only); to None: no update.
  STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt.get(), w, 1));
  STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
  REQUIRE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.f; }));
  strata_tensor_t* none = m.weights[2][1];
  STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt.get(), none, 0));
  const auto none_before = read_bf16(m.rt.get(), none, m.sizes[1]);
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt.get()));
  REQUIRE(read_bf16(m.rt.get(), none, m.sizes[1]) == none_before);
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), none, &info));
  REQUIRE(info.step == 0);
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
  REQUIRE(info.step == 1);
  strata_tensor_t* master = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, STRATA_STATE_EXP_AVG, &master));
  std::vector<float> m1(n);
  STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), master, 0, m1.data(), n * 4));
  REQUIRE(std::all_of(m1.begin(), m1.end(), [](float x) { return x == 0.f; }));
  STRATA_REQUIRE_OK(strata_optimizer_set_param_step(opt.get(), w, 9));
  STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
  REQUIRE(info.step == 9);
}

TEST_CASE("explicit updates: a held grad written back (torch's clamp_ on p.grad), in either home",
          "[optimizer]") {
  for (strata_tier_t home : {STRATA_TIER_DRAM, STRATA_TIER_HBM}) {
    DYNAMIC_SECTION("grads in " << (home == STRATA_TIER_HBM ? "HBM" : "DRAM")) {
      strata_optimizer_config_t c = adamw_config();
      c.update_mode = STRATA_UPDATE_EXPLICIT;
      Model m =
          make_model(3, 7, backend_under_test(), {3000, 1100}, nullptr, STRATA_TIER_DRAM, home);
      OptimizerPtr opt = make_optimizer(m, c);
      Streamed st;
      attach_streamed(m, opt.get(), &st);
      strata_tensor_t* w = m.weights[1][0];
      const auto n = static_cast<std::size_t>(m.sizes[0]);
      const auto weights = read_bf16(m.rt.get(), w, m.sizes[0]);
      std::vector<float> got(n), values(n);
      REQUIRE(strata_optimizer_grad_write(opt.get(), w, values.data(), n) ==
              STRATA_ERROR_INVALID_STATE);  // None: nothing to write into
      strata_grad_info_t info{};
      info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
      const auto squares_of = [](const std::vector<float>& v) {
        double s = 0;
        for (float x : v) s += double{x} * x;
        return s;
      };

      // The grad of one backward pass, scaled lazily, then clamped by the framework: stored
      // in the grad tensor's bf16 (rounded to nearest even), the factor replaced.
      streamed_pass(m, st.ex, 0, 0);
      const auto g1 = grads_for(weights, 0, 1, 0);
      STRATA_REQUIRE_OK(strata_optimizer_grad_scale(opt.get(), w, 3.f));
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(got[i] == from_bf16(g1[i]) * 3.f);
        values[i] = std::clamp(got[i], -0.1f, 0.1f) + 1e-4f;  // most not a bf16
      }
      STRATA_REQUIRE_OK(strata_optimizer_grad_write(opt.get(), w, values.data(), n));
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      std::vector<float> stored(n);
      for (std::size_t i = 0; i < n; ++i) stored[i] = from_bf16(to_bf16(values[i]));
      REQUIRE(got == stored);
      REQUIRE(got != values);
      STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
      REQUIRE(info.has_grad == 1);
      REQUIRE(info.sum_squares == Approx(squares_of(stored)).epsilon(1e-6));

      // The next backward pass adds to the written grad in the fp32 accumulator; a write
      // there is stored exactly, and the pass after it adds to it again.
      streamed_pass(m, st.ex, 0, 1);
      const auto g2 = grads_for(weights, 0, 1, 1);
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == stored[i] + from_bf16(g2[i]));
      for (std::size_t i = 0; i < n; ++i) values[i] = std::clamp(got[i], -0.05f, 0.07f) / 3.f;
      STRATA_REQUIRE_OK(strata_optimizer_grad_scale(opt.get(), w, 0.25f));
      STRATA_REQUIRE_OK(strata_optimizer_grad_write(opt.get(), w, values.data(), n));
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      REQUIRE(got == values);
      STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), w, &info));
      REQUIRE(info.sum_squares == Approx(squares_of(values)).epsilon(1e-6));
      streamed_pass(m, st.ex, 0, 2);
      const auto g3 = grads_for(weights, 0, 1, 2);
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      for (std::size_t i = 0; i < n; ++i) REQUIRE(got[i] == values[i] + from_bf16(g3[i]));

      // Zeroed to zeros, then written: the grad tensor holds it again, and the update uses it
      // (AdamW's first step: m = (1 - beta1) g).
      STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt.get(), w, 1));
      for (std::size_t i = 0; i < n; ++i) values[i] = from_bf16(to_bf16(0.01f * (i % 7) - 0.03f));
      STRATA_REQUIRE_OK(strata_optimizer_grad_write(opt.get(), w, values.data(), n));
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      REQUIRE(got == values);
      STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
      // Written while the update is queued: the update still sees the values it was queued with.
      std::vector<float> zeros(n, 0.f);
      STRATA_REQUIRE_OK(strata_optimizer_grad_write(opt.get(), w, zeros.data(), n));
      STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt.get()));
      strata_tensor_t* exp_avg = nullptr;
      STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, STRATA_STATE_EXP_AVG, &exp_avg));
      std::vector<float> m1(n);
      STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), exp_avg, 0, m1.data(), n * 4));
      for (std::size_t i = 0; i < n; ++i) {
        REQUIRE(m1[i] == Approx((1.f - c.beta1) * values[i]).epsilon(1e-6).margin(1e-12));
      }
      STRATA_REQUIRE_OK(strata_optimizer_grad_read(opt.get(), w, got.data(), n));
      REQUIRE(got == zeros);

      REQUIRE(strata_optimizer_grad_write(opt.get(), w, values.data(), n - 1) ==
              STRATA_ERROR_INVALID_ARGUMENT);
      REQUIRE(strata_optimizer_grad_write(opt.get(), m.grads[0][0], values.data(), n) ==
              STRATA_ERROR_NOT_FOUND);
      STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt.get(), w, 0));
      REQUIRE(strata_optimizer_grad_write(opt.get(), w, values.data(), n) ==
              STRATA_ERROR_INVALID_STATE);
    }
  }
}

TEST_CASE("explicit updates: the first accumulation waits for the previous step's updates",
          "[optimizer]") {
  // The first backward pass onto grads not zeroed (torch's loop without zero_grad) places every
  // param's fp32 accumulator; the previous strata_optimizer_step's updates may still run then,
  // and every job reads each of its params' accumulator pointer. Run with the second step
  // begun as soon as layer 0's update has finished (update_seconds moved), so a later layer's
  // update is running or queued while the placement runs: under TSan a placement that did not
  // wait for it is a data race on the pointer (the defect fixed in 3fb1b9c). Either way the
  // result must equal the same steps with every update waited for before the second begins.
  const std::vector<int64_t> sizes{1 << 19, 1 << 17};  // updates long enough to overlap
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  auto run = [&](bool overlap) {
    Model m = make_model(6, 11, backend_under_test(), sizes);
    OptimizerPtr opt = make_optimizer(m, c);
    Streamed st;
    attach_streamed(m, opt.get(), &st);
    streamed_pass(m, st.ex, 0, 0);
    STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt.get()));  // the landings: not updates
    const double landed = stats_of(opt.get()).update_seconds;
    STRATA_REQUIRE_OK(strata_optimizer_set_group(opt.get(), 0, 1e-2f, 0.1f));
    STRATA_REQUIRE_OK(strata_optimizer_set_group(opt.get(), 1, 1e-2f, 0.f));
    STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
    if (overlap) {
      // The updates run in forward order, one layer's at a time: once layer 0's has added its
      // time, the dispatcher goes on to layer 1's.
      while (stats_of(opt.get()).update_seconds == landed) std::this_thread::yield();
    } else {
      STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt.get()));
    }
    queue_explicit_step(m, opt.get(), st.ex, 1);  // its pass adds to the held grads
    STRATA_REQUIRE_OK(strata_optimizer_synchronize(opt.get()));
    strata_grad_info_t info{};
    info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_optimizer_grad_info(opt.get(), m.weights[5][1], &info));
    REQUIRE(info.has_grad == 1);
    REQUIRE(info.step == 2);
    return snapshot(m, opt.get());
  };
  REQUIRE(run(true) == run(false));
}

TEST_CASE("an abandoned step changes nothing but the grads whose backward was done",
          "[optimizer]") {
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  Model aborted = make_model(4, 5, backend_under_test());
  Model clean = make_model(4, 5, backend_under_test());
  OptimizerPtr ao = make_optimizer(aborted, c);
  OptimizerPtr co = make_optimizer(clean, c);
  Streamed as, cs;
  make_streamed(aborted, &as, 0);
  make_streamed(clean, &cs, 0);
  STRATA_REQUIRE_OK(strata_optimizer_attach(ao.get(), as.ex));
  STRATA_REQUIRE_OK(strata_optimizer_attach(co.get(), cs.ex));
  // Abandoned mid-forward, and with a layer acquired mid-backward (layers 3 and 2 done).
  streamed_pass(aborted, as.ex, 0, 0, 2);
  streamed_pass(aborted, as.ex, 0, 0, 6);
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  for (uint32_t l = 0; l < 4; ++l) {
    STRATA_REQUIRE_OK(strata_optimizer_grad_info(ao.get(), aborted.weights[l][0], &info));
    REQUIRE(info.has_grad == (l >= 2 ? 1 : 0));
  }
  for (auto& layer : aborted.weights) {
    for (strata_tensor_t* w : layer) STRATA_REQUIRE_OK(strata_optimizer_grad_zero(ao.get(), w, 0));
  }
  REQUIRE(strata_step_abort(as.ex, nullptr) == STRATA_OK);  // no step: nothing to do
  run_explicit(aborted, ao.get(), as.ex, 0, 3, 1);
  run_explicit(clean, co.get(), cs.ex, 0, 3, 1);
  REQUIRE(snapshot(aborted, ao.get()) == snapshot(clean, co.get()));
}

TEST_CASE("explicit update mode misuse gets clear errors", "[optimizer]") {
  Model m = make_model(2, 3, backend_under_test());
  strata_optimizer_config_t bad = adamw_config();
  bad.update_mode = 7;
  strata_optimizer_t* o = nullptr;
  REQUIRE(strata_optimizer_create(m.rt.get(), &bad, &o) == STRATA_ERROR_INVALID_ARGUMENT);
  bad.update_mode = STRATA_UPDATE_EXPLICIT;
  bad.max_grad_norm = 1.f;
  REQUIRE(strata_optimizer_create(m.rt.get(), &bad, &o) == STRATA_ERROR_INVALID_ARGUMENT);
  REQUIRE(std::string(strata_last_error_message()).find("explicit") != std::string::npos);

  // A caller built against the 1.0 header: its config ends at `threads`, and means AUTO mode.
  strata_optimizer_config_t v1_0 = adamw_config();
  v1_0.update_mode = STRATA_UPDATE_EXPLICIT;  // beyond its struct_size: never read
  v1_0.struct_size = STRATA_STRUCT_SIZE(strata_optimizer_config_t, threads);
  OptimizerPtr autoopt = make_optimizer(m, v1_0);
  strata_grad_info_t info{};
  info.struct_size = STRATA_GRAD_INFO_STRUCT_SIZE;
  REQUIRE(strata_optimizer_grad_info(autoopt.get(), m.weights[0][0], &info) ==
          STRATA_ERROR_INVALID_STATE);
  REQUIRE(strata_optimizer_set_param_step(autoopt.get(), m.weights[0][0], 1) ==
          STRATA_ERROR_INVALID_STATE);
  autoopt.reset();

  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  OptimizerPtr opt = make_optimizer(m, c);
  REQUIRE(strata_optimizer_grad_info(opt.get(), m.weights[0][0], &info) ==
          STRATA_ERROR_INVALID_STATE);
  Streamed st;
  make_streamed(m, &st, 0);
  STRATA_REQUIRE_OK(strata_optimizer_attach(opt.get(), st.ex));
  REQUIRE(strata_optimizer_grad_info(opt.get(), m.grads[0][0], &info) == STRATA_ERROR_NOT_FOUND);
  REQUIRE(strata_optimizer_grad_scale(opt.get(), m.weights[0][0], 2.f) ==
          STRATA_ERROR_INVALID_STATE);
  REQUIRE(strata_optimizer_grad_read(opt.get(), m.weights[0][0], nullptr, 1) ==
          STRATA_ERROR_INVALID_ARGUMENT);
  STRATA_REQUIRE_OK(strata_step_begin(st.ex));
  REQUIRE(strata_optimizer_step(opt.get()) == STRATA_ERROR_INVALID_STATE);
  REQUIRE(strata_step_abort(nullptr, nullptr) == STRATA_ERROR_INVALID_ARGUMENT);
  STRATA_REQUIRE_OK(strata_step_abort(st.ex, nullptr));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));  // nothing held: no update
}

TEST_CASE("a resumed run continues bit for bit", "[checkpoint]") {
  ScratchDir scratch;
  const std::string ckpt = scratch.file("ckpt");
  for (auto [streamed, layout] : {std::pair{false, STRATA_MASTER_SEPARATE},
                                  {true, STRATA_MASTER_SEPARATE},
                                  {true, STRATA_MASTER_SPLIT}}) {
    DYNAMIC_SECTION((streamed ? "executor-driven" : "manual steps")
                    << (layout == STRATA_MASTER_SPLIT ? ", split masters" : "")) {
      strata_optimizer_config_t c = adamw_config();
      c.loss_scale = 8.f;
      c.dynamic_loss_scale = 1;
      c.growth_interval = 3;
      auto run = [&](Model& m, strata_optimizer_t* opt, int first, int steps) {
        if (!streamed) return run_manual(m, opt, first, steps, 1);
        Streamed st;
        make_streamed(m, &st, 0);
        STRATA_REQUIRE_OK(strata_optimizer_attach(opt, st.ex));
        run_streamed(m, opt, st.ex, first, steps, 1);
      };
      // Uninterrupted: 8 steps.
      // Executor-driven runs use the backend under test; manual ones need no device.
      const strata_device_backend_t backend =
          streamed ? backend_under_test() : STRATA_DEVICE_BACKEND_HOST;
      Model a = make_model(3, 9, backend);
      OptimizerPtr ao = make_optimizer(a, c, layout);
      run(a, ao.get(), 0, 8);
      // Interrupted: 5 steps, save, a new process-like start from the same init, load, 3 more.
      {
        Model b = make_model(3, 9, backend);
        OptimizerPtr bo = make_optimizer(b, c, layout);
        run(b, bo.get(), 0, 5);
        STRATA_REQUIRE_OK(strata_checkpoint_save(b.rt.get(), bo.get(), ckpt.c_str()));
      }
      Model r = make_model(3, 1234, backend);  // another init: the load overwrites it
      OptimizerPtr ro = make_optimizer(r, c, layout);
      STRATA_REQUIRE_OK(strata_checkpoint_load(r.rt.get(), ro.get(), ckpt.c_str()));
      strata_optimizer_stats_t s = stats_of(ro.get());
      REQUIRE(s.step == 5);
      run(r, ro.get(), 5, 3);
      REQUIRE(snapshot(r, ro.get()) == snapshot(a, ao.get()));
      s = stats_of(ro.get());
      const strata_optimizer_stats_t sa = stats_of(ao.get());
      REQUIRE(s.step == sa.step);
      REQUIRE(s.loss_scale == sa.loss_scale);
    }
  }
}

TEST_CASE("bad checkpoints are refused before anything is written", "[checkpoint]") {
  ScratchDir scratch;
  const std::string ckpt = scratch.file("ckpt");
  Model m = make_model(2, 5, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t c = adamw_config();
  OptimizerPtr opt = make_optimizer(m, c);
  run_manual(m, opt.get(), 0, 2, 1);
  STRATA_REQUIRE_ERROR(strata_checkpoint_load(m.rt.get(), opt.get(), ckpt.c_str()),
                       STRATA_ERROR_NOT_FOUND, "ckpt");
  STRATA_REQUIRE_OK(strata_checkpoint_save(m.rt.get(), opt.get(), ckpt.c_str()));
  REQUIRE(std::filesystem::exists(ckpt + "/model.safetensors"));
  REQUIRE(!std::filesystem::exists(ckpt + ".partial"));

  // A model with a differently shaped weight: refused, names the tensor, writes nothing.
  Model other = make_model(2, 6, STRATA_DEVICE_BACKEND_HOST);
  OptimizerPtr other_opt = make_optimizer(other, c);
  register_tensor(other.rt.get(), "extra", 10, STRATA_DTYPE_F32, STRATA_ROLE_WEIGHT);
  const auto other_before = snapshot(other, other_opt.get());
  STRATA_REQUIRE_ERROR(strata_checkpoint_load(other.rt.get(), other_opt.get(), ckpt.c_str()),
                       STRATA_ERROR_INVALID_ARGUMENT, "extra");
  REQUIRE(snapshot(other, other_opt.get()) == other_before);

  // SGD state is not AdamW state.
  Model sgd_model = make_model(2, 5, STRATA_DEVICE_BACKEND_HOST);
  strata_optimizer_config_t sc;
  strata_optimizer_config_init(STRATA_OPTIMIZER_SGD, &sc);
  OptimizerPtr sgd = make_optimizer(sgd_model, sc);
  STRATA_REQUIRE_ERROR(strata_checkpoint_load(sgd_model.rt.get(), sgd.get(), ckpt.c_str()),
                       STRATA_ERROR_INVALID_ARGUMENT, "adamw");

  // A flipped byte in the optimizer's data: DATA_CORRUPTION, and no stepping until a good load.
  {
    std::fstream f(ckpt + "/optimizer.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(-100, std::ios::end);
    f.write(&b, 1);
  }
  STRATA_REQUIRE_ERROR(strata_checkpoint_load(m.rt.get(), opt.get(), ckpt.c_str()),
                       STRATA_ERROR_DATA_CORRUPTION, "optimizer.safetensors");
  STRATA_REQUIRE_ERROR(strata_optimizer_step(opt.get()), STRATA_ERROR_DATA_CORRUPTION,
                       "partly loaded");
  // Weights only (no optimizer) still load from the intact model file.
  STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), nullptr, ckpt.c_str()));
}

TEST_CASE("SIGKILL in the middle of a save leaves the previous checkpoint whole",
          "[checkpoint][slow]") {
#if defined(__SANITIZE_THREAD__)
  WARN("skipped: ThreadSanitizer does not support threads in a forked child");
  return;
#endif
  ScratchDir scratch;
  const std::string ckpt = scratch.file("ckpt");
  // Each save writes a model whose every weight element holds the generation number: a loaded
  // checkpoint must hold one generation throughout, and one no older than the last completed.
  const int64_t n = 4 << 20;  // 4 M fp32 elements per weight, 3 weights: 48 MiB of weights
  auto build = [&](Model& m) {
    m.rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 8 * kMiB, 512 * kMiB));
    for (int k = 0; k < 3; ++k) {
      const std::string name = "w" + std::to_string(k);
      m.weights.push_back(
          {register_tensor(m.rt.get(), name, n, STRATA_DTYPE_F32, STRATA_ROLE_WEIGHT)});
      m.grads.push_back(
          {register_tensor(m.rt.get(), name + ".grad", n, STRATA_DTYPE_F32, STRATA_ROLE_GRAD)});
    }
  };
  std::mt19937 rng(99);
  for (int round = 0; round < 6; ++round) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      close(fds[0]);
      Model m;
      build(m);
      strata_optimizer_config_t c = adamw_config();
      strata_optimizer_t* o = nullptr;
      if (strata_optimizer_create(m.rt.get(), &c, &o) != STRATA_OK) _exit(2);
      for (int k = 0; k < 3; ++k) {
        strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE,
                              m.weights[k][0],
                              m.grads[k][0],
                              0,
                              STRATA_MASTER_SEPARATE,
                              STRATA_GRAD_SUM_ACCUMULATOR};
        if (strata_optimizer_add_param(o, &p) != STRATA_OK) _exit(2);
      }
      std::vector<float> v(static_cast<std::size_t>(n));
      for (int gen = 1;; ++gen) {
        std::fill(v.begin(), v.end(), static_cast<float>(gen + round * 1000));
        for (int k = 0; k < 3; ++k) {
          if (strata_tensor_write(m.rt.get(), m.weights[k][0], 0, v.data(), v.size() * 4) !=
              STRATA_OK) {
            _exit(3);
          }
        }
        if (strata_checkpoint_save(m.rt.get(), o, ckpt.c_str()) != STRATA_OK) _exit(4);
        const int done = gen + round * 1000;
        if (write(fds[1], &done, sizeof done) != sizeof done) _exit(5);
      }
    }
    close(fds[1]);
    // Let a few saves complete, then kill at a random moment of a later one.
    int last = 0;
    for (int i = 0; i < 2; ++i) REQUIRE(read(fds[0], &last, sizeof last) == sizeof last);
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 60)(rng)));
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    int more = 0;
    while (read(fds[0], &more, sizeof more) == sizeof more) last = more;
    close(fds[0]);

    Model m;
    build(m);
    STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), nullptr, ckpt.c_str()));
    std::vector<float> v(static_cast<std::size_t>(n));
    float gen = -1;
    for (int k = 0; k < 3; ++k) {
      STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), m.weights[k][0], 0, v.data(), v.size() * 4));
      if (gen < 0) gen = v[0];
      REQUIRE(std::all_of(v.begin(), v.end(), [&](float x) { return x == gen; }));
    }
    INFO("round " << round << ": loaded generation " << gen << ", last completed " << last);
    REQUIRE(gen >= static_cast<float>(last));
    REQUIRE(gen <= static_cast<float>(last + 1));  // at most the save being killed, if it committed
  }
}

TEST_CASE("SIGKILL in the middle of a load leaves the checkpoint whole", "[checkpoint][slow]") {
#if defined(__SANITIZE_THREAD__)
  WARN("skipped: ThreadSanitizer does not support threads in a forked child");
  return;
#endif
  // A load writes nothing on disk: whenever the loading process dies, the checkpoint still
  // loads whole, with the optimizer's state.
  ScratchDir scratch;
  const std::string ckpt = scratch.file("ckpt");
  const int64_t n = 4 << 20;
  auto build = [&](Model& m, OptimizerPtr* opt) {
    m.rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 8 * kMiB, 512 * kMiB));
    for (int k = 0; k < 3; ++k) {
      const std::string name = "w" + std::to_string(k);
      m.weights.push_back(
          {register_tensor(m.rt.get(), name, n, STRATA_DTYPE_F32, STRATA_ROLE_WEIGHT)});
      m.grads.push_back(
          {register_tensor(m.rt.get(), name + ".grad", n, STRATA_DTYPE_F32, STRATA_ROLE_GRAD)});
    }
    strata_optimizer_config_t c = adamw_config();
    strata_optimizer_t* o = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &o));
    opt->reset(o);
    for (int k = 0; k < 3; ++k) {
      strata_param_desc_t p{
          STRATA_PARAM_DESC_STRUCT_SIZE, m.weights[k][0], m.grads[k][0], 0, STRATA_MASTER_SEPARATE,
          STRATA_GRAD_SUM_ACCUMULATOR};
      STRATA_REQUIRE_OK(strata_optimizer_add_param(o, &p));
    }
  };
  {
    Model m;
    OptimizerPtr o;
    build(m, &o);
    std::vector<float> v(static_cast<std::size_t>(n), 7.f);
    for (int k = 0; k < 3; ++k) {
      STRATA_REQUIRE_OK(strata_tensor_write(m.rt.get(), m.weights[k][0], 0, v.data(), n * 4));
    }
    STRATA_REQUIRE_OK(strata_checkpoint_save(m.rt.get(), o.get(), ckpt.c_str()));
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 4; ++round) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      close(fds[0]);
      Model m;
      OptimizerPtr o;
      build(m, &o);
      for (int i = 1;; ++i) {
        if (strata_checkpoint_load(m.rt.get(), o.get(), ckpt.c_str()) != STRATA_OK) _exit(4);
        if (write(fds[1], &i, sizeof i) != sizeof i) _exit(5);
      }
    }
    close(fds[1]);
    int done = 0;
    REQUIRE(read(fds[0], &done, sizeof done) == sizeof done);
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 40)(rng)));
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));
    close(fds[0]);
    Model m;
    OptimizerPtr o;
    build(m, &o);
    STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), o.get(), ckpt.c_str()));
    std::vector<float> v(static_cast<std::size_t>(n));
    for (int k = 0; k < 3; ++k) {
      STRATA_REQUIRE_OK(strata_tensor_read(m.rt.get(), m.weights[k][0], 0, v.data(), n * 4));
      REQUIRE(std::all_of(v.begin(), v.end(), [](float x) { return x == 7.f; }));
    }
  }
}

// For tests/python/core/test_safetensors_compat.py: a small checkpoint with known contents, where
// STRATA_CHECKPOINT_OUT says (ctest sets it; the Python test reads it with Hugging Face's
// safetensors). Weights: "embed" f32 [2, 3] = 0..5 and "layers.0.w" bf16 [4] = 1, 2, 3, 4, one
// SGD step (lr 1, no momentum) with grads of 0.5 applied to the bf16 weight: 0.5, 1.5, ...
TEST_CASE("a checkpoint for the safetensors compatibility test", "[checkpoint]") {
  const char* out = std::getenv("STRATA_CHECKPOINT_OUT");
  if (out == nullptr) return;
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 8 * kMiB, 64 * kMiB));
  const int64_t shape2[2] = {2, 3};
  strata_tensor_desc_t d = desc("embed", shape2, 2, STRATA_TIER_DRAM, STRATA_DTYPE_F32);
  strata_tensor_t* embed = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(rt.get(), &d, &embed));
  const float e[6] = {0, 1, 2, 3, 4, 5};
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), embed, 0, e, sizeof e));
  strata_tensor_t* w =
      register_tensor(rt.get(), "layers.0.w", 4, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT);
  strata_tensor_t* g =
      register_tensor(rt.get(), "layers.0.w.grad", 4, STRATA_DTYPE_BF16, STRATA_ROLE_GRAD);
  const uint16_t wv[4] = {to_bf16(1), to_bf16(2), to_bf16(3), to_bf16(4)};
  const uint16_t gv[4] = {to_bf16(0.5f), to_bf16(0.5f), to_bf16(0.5f), to_bf16(0.5f)};
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), w, 0, wv, sizeof wv));
  STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), g, 0, gv, sizeof gv));
  strata_optimizer_config_t c;
  strata_optimizer_config_init(STRATA_OPTIMIZER_SGD, &c);
  c.lr = 1.f;
  strata_optimizer_t* o = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &c, &o));
  OptimizerPtr opt(o);
  strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, STRATA_MASTER_SEPARATE,
                        STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
  STRATA_REQUIRE_OK(strata_optimizer_step(opt.get()));
  STRATA_REQUIRE_OK(strata_checkpoint_save(rt.get(), opt.get(), out));
}

// The optimizer does not zero a DRAM state block no tensor held since the arena was mapped (it
// is zero already, Runtime::register_tensor) and zeroes every other: state laid where freed
// tensors of 0xFF bytes were must read zero all the same, in both master layouts.
TEST_CASE("new optimizer state reads zero over fresh DRAM and over DRAM freed tensors held",
          "[optimizer]") {
  for (bool dirty : {false, true}) {
    CAPTURE(dirty);
    RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 16 * kMiB, 16 * kMiB));
    if (dirty) {  // every byte of the arena held a tensor of 0xFF bytes, then freed
      std::vector<strata_tensor_t*> fill;
      const std::vector<unsigned char> ones(kMiB / 4, 0xFF);
      for (int k = 0;; ++k) {
        const int64_t shape[1] = {static_cast<int64_t>(ones.size())};
        const std::string name = "fill" + std::to_string(k);
        const strata_tensor_desc_t d = desc(name.c_str(), shape, 1, STRATA_TIER_DRAM);
        strata_tensor_t* t = nullptr;
        if (strata_tensor_register(rt.get(), &d, &t) != STRATA_OK) break;
        STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), t, 0, ones.data(), ones.size()));
        fill.push_back(t);
      }
      REQUIRE(fill.size() >= 60);  // 16 MiB in blocks of 256 KiB
      for (strata_tensor_t* t : fill) STRATA_REQUIRE_OK(strata_tensor_unregister(rt.get(), t));
    }
    strata_optimizer_config_t c = adamw_config();
    c.threads = 2;
    strata_optimizer_t* o = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &c, &o));
    OptimizerPtr opt(o);
    const int64_t n = 100000;
    for (uint32_t layout : {STRATA_MASTER_SEPARATE, STRATA_MASTER_SPLIT}) {
      CAPTURE(layout);
      const std::string base = "w" + std::to_string(layout);
      strata_tensor_t* w =
          register_tensor(rt.get(), base, n, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT);
      strata_tensor_t* g =
          register_tensor(rt.get(), base + ".grad", n, STRATA_DTYPE_BF16, STRATA_ROLE_GRAD);
      std::vector<uint16_t> values(static_cast<std::size_t>(n));
      for (int64_t i = 0; i < n; ++i) values[i] = to_bf16(0.001f * static_cast<float>(i % 977));
      STRATA_REQUIRE_OK(strata_tensor_write(rt.get(), w, 0, values.data(), 2 * values.size()));
      strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, layout,
                            STRATA_GRAD_SUM_ACCUMULATOR};
      STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
      std::vector<strata_state_kind_t> zero_states = {STRATA_STATE_EXP_AVG,
                                                      STRATA_STATE_EXP_AVG_SQ};
      if (layout == STRATA_MASTER_SPLIT) zero_states.push_back(STRATA_STATE_MASTER_LOW);
      for (strata_state_kind_t which : zero_states) {
        CAPTURE(which);
        strata_tensor_t* state = nullptr;
        STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, which, &state));
        strata_tensor_info_t info{};
        info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
        STRATA_REQUIRE_OK(strata_tensor_get_info(rt.get(), state, &info));
        std::vector<unsigned char> bytes(info.nbytes, 0xAB);
        STRATA_REQUIRE_OK(strata_tensor_read(rt.get(), state, 0, bytes.data(), bytes.size()));
        REQUIRE(std::count(bytes.begin(), bytes.end(), 0) == static_cast<long>(bytes.size()));
      }
      if (layout == STRATA_MASTER_SEPARATE) {  // the master starts as the weight, widened
        strata_tensor_t* master = nullptr;
        STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, STRATA_STATE_MASTER, &master));
        std::vector<float> m(static_cast<std::size_t>(n));
        STRATA_REQUIRE_OK(strata_tensor_read(rt.get(), master, 0, m.data(), 4 * m.size()));
        for (int64_t i = 0; i < n; i += 997) REQUIRE(m[i] == from_bf16(values[i]));
      }
    }
  }
}

int main(int argc, char** argv) {
  return run_on_backend_under_test(argc, argv);
}

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
