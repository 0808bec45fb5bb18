// The optimizer through the C ABI, on the backend under test: updates driven by the executor's
// steps equal the same updates run by hand (so each layer's update lands before its next load,
// and grads are whole when read); clipping, the other kinds, loss scaling; steps from two
// threads; misuse; new state zeroed. The explicit update mode, checkpoints and masters are
// test_optimizer_{explicit,checkpoints,masters}.cpp (the same executable; main is here).
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

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
