// The optimizer's explicit update mode through the C ABI (a framework such as PyTorch owns the
// loop): any accumulation equals updates by hand; held grads read, measured, scaled, zeroed and
// written back as torch's p.grad; the first accumulation waits for the previous step's updates;
// an abandoned step; misuse.
#include <algorithm>
#include <thread>

#include "optimizer/optimizer_model.h"
#include "support/device_views.h"

using namespace strata_test;

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
