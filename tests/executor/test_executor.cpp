// The layer executor through the C ABI, on the backend under test (STRATA_TEST_BACKEND): a test
// "framework" runs randomized graphs and checks every byte it is handed, across steps, with and
// without slowed copies; misuse gets an error, never a hang (a watchdog aborts a stuck test).
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <thread>

#include "support/device_views.h"

using namespace strata_test;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

// ThreadSanitizer slows this suite ~20x: it checks fewer random graphs there (the same
// seeds, a prefix of them), and still every code path.
#if defined(__SANITIZE_THREAD__)
constexpr int kDefaultTrials = 6;
#else
constexpr int kDefaultTrials = 24;
#endif

// The soak (scripts/soak.sh) runs other graphs: STRATA_TEST_SEED shifts every trial's seed,
// STRATA_TEST_TRIALS sets how many. Unset: the fixed graphs CI checks.
uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

// Runs `body` and fails (aborting the process) if it takes longer than `seconds` (three times
// that under ThreadSanitizer, whose slowdown on a busy machine made 120 s graphs time out in
// the soak although they progressed): a deadlock becomes a test failure instead of a hung CI
// job.
void with_watchdog(int seconds, const std::function<void()>& body) {
#if defined(__SANITIZE_THREAD__)
  seconds *= 3;
#endif
  auto done = std::make_shared<std::promise<void>>();
  std::thread watchdog([seconds, f = done->get_future()]() mutable {
    if (f.wait_for(std::chrono::seconds(seconds)) == std::future_status::timeout) {
      std::fprintf(stderr, "WATCHDOG: test still running after %d s: deadlock\n", seconds);
      std::abort();
    }
  });
  try {
    body();
  } catch (...) {
    done->set_value();
    watchdog.join();
    throw;
  }
  done->set_value();
  watchdog.join();
}

// Eight bytes per xorshift step: the byte-at-a-time version dominated the soak's TSan runs
// (an unoptimized, instrumented loop over tens of MiB per graph).
std::vector<unsigned char> pattern(uint64_t n, uint64_t seed) {
  std::vector<unsigned char> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t at = 0; at < n; at += sizeof x) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(v.data() + at, &x, std::min<uint64_t>(sizeof x, n - at));
  }
  return v;
}

struct TensorInfo {
  strata_tensor_t* handle;
  uint64_t bytes;
  uint64_t tag;  // pattern seed base
};

struct Layer {
  std::vector<TensorInfo> weights, grads, activations;
};

struct Model {
  RuntimePtr rt;
  std::vector<Layer> layers;
  std::vector<TensorInfo> residents;
  strata_graph_t* graph = nullptr;
  ~Model() { strata_graph_destroy(graph); }
};

TensorInfo make_tensor(strata_runtime_t* rt, const std::string& name, uint64_t bytes,
                       strata_tier_t home, uint64_t tag) {
  return TensorInfo{register_bytes(rt, name, bytes, home), bytes, tag};
}

// A random model: layers of 1-4 weights (1 byte to 3 MiB), grads for some weights, 0-2
// checkpoints; registered either layer by layer (weights contiguous: copied as one span) or
// interleaved across layers (one copy per tensor).
void build_model(Model& m, std::mt19937_64& rng, uint64_t hbm, uint64_t bps, bool nvme_layers,
                 ScratchDir& scratch) {
  const std::string file = scratch.file("nvme" + std::to_string(rng()));
  const char* paths[1] = {file.c_str()};
  strata_runtime_config_t c =
      config_for(backend_under_test(), hbm, 256 * kMiB,
                 backend_under_test() == STRATA_DEVICE_BACKEND_HOST ? bps : 0);
  if (nvme_layers) {
    c.nvme_paths = paths;
    c.nvme_path_count = 1;
    c.nvme_budget_bytes = 128 * kMiB;
    c.nvme_checksums = 1;
    c.io_queue_depth = 4;
  }
  m.rt = make_runtime(c);
  const int layers = 1 + static_cast<int>(rng() % 8);
  const bool interleave = rng() % 2 == 0;
  m.layers.resize(static_cast<std::size_t>(layers));
  uint64_t tag = 1;
  auto size = [&] {
    const int kind = static_cast<int>(rng() % 4);
    return kind == 0 ? 1 + rng() % 300 : kind == 1 ? 1 + rng() % 70000 : 1 + rng() % (3 * kMiB);
  };
  std::vector<std::pair<int, int>> order;  // (layer, weight index)
  std::vector<int> weight_counts;
  for (int l = 0; l < layers; ++l) {
    const int n = 1 + static_cast<int>(rng() % 4);
    weight_counts.push_back(n);
    for (int w = 0; w < n; ++w) order.emplace_back(l, w);
  }
  if (interleave) std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<TensorInfo>> weights(static_cast<std::size_t>(layers));
  for (auto& w : weights) w.resize(8);
  for (auto [l, w] : order) {
    const bool on_nvme = nvme_layers && l % 2 == 1;
    weights[static_cast<std::size_t>(l)][static_cast<std::size_t>(w)] =
        make_tensor(m.rt.get(), "l" + std::to_string(l) + ".w" + std::to_string(w), size(),
                    on_nvme ? STRATA_TIER_NVME : STRATA_TIER_DRAM, tag++ * 1000);
  }
  for (int l = 0; l < layers; ++l) {
    Layer& layer = m.layers[static_cast<std::size_t>(l)];
    for (int w = 0; w < weight_counts[static_cast<std::size_t>(l)]; ++w) {
      layer.weights.push_back(weights[static_cast<std::size_t>(l)][static_cast<std::size_t>(w)]);
      if (rng() % 2 == 0) {
        layer.grads.push_back(
            make_tensor(m.rt.get(), "l" + std::to_string(l) + ".g" + std::to_string(w),
                        layer.weights.back().bytes, STRATA_TIER_DRAM, tag++ * 1000));
      }
    }
    const int acts = static_cast<int>(rng() % 3);
    for (int a = 0; a < acts; ++a) {
      layer.activations.push_back(make_tensor(m.rt.get(),
                                              "l" + std::to_string(l) + ".a" + std::to_string(a),
                                              1 + rng() % kMiB, STRATA_TIER_DRAM, tag++ * 1000));
    }
  }
  const int residents = static_cast<int>(rng() % 3);
  for (int r = 0; r < residents; ++r) {
    m.residents.push_back(make_tensor(m.rt.get(), "resident" + std::to_string(r), 1 + rng() % kMiB,
                                      STRATA_TIER_DRAM, tag++ * 1000));
  }
  STRATA_REQUIRE_OK(strata_graph_create(m.rt.get(), &m.graph));
  for (const Layer& layer : m.layers) {
    std::vector<strata_tensor_t*> w, g, a;
    for (auto& t : layer.weights) w.push_back(t.handle);
    for (auto& t : layer.grads) g.push_back(t.handle);
    for (auto& t : layer.activations) a.push_back(t.handle);
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = w.data();
    d.weight_count = static_cast<uint32_t>(w.size());
    d.grads = g.data();
    d.grad_count = static_cast<uint32_t>(g.size());
    d.activations = a.data();
    d.activation_count = static_cast<uint32_t>(a.size());
    STRATA_REQUIRE_OK(strata_graph_add_layer(m.graph, &d, nullptr));
  }
  for (auto& r : m.residents) STRATA_REQUIRE_OK(strata_graph_add_resident(m.graph, r.handle));
}

void write_tensor(strata_runtime_t* rt, const TensorInfo& t, uint64_t seed) {
  const auto data = pattern(t.bytes, seed);
  STRATA_REQUIRE_OK(strata_tensor_write(rt, t.handle, 0, data.data(), data.size()));
}

void expect_view(const void* view, const TensorInfo& t, uint64_t seed, const char* what) {
  std::vector<unsigned char> got(t.bytes);
  view_to_host(got.data(), view, t.bytes);
  INFO(what << " of " << t.bytes << " bytes, seed " << seed);
  REQUIRE(got == pattern(t.bytes, seed));
}

// The test framework: every step checks what it is handed and writes what it produces.
void run_steps(Model& m, strata_executor_t* ex, int steps, uint32_t micro_batches,
               bool per_tensor) {
  strata_runtime_t* rt = m.rt.get();
  const uint32_t L = static_cast<uint32_t>(m.layers.size());
  for (int step = 0; step < steps; ++step) {
    // The "optimizer" of the previous step: new weights every step.
    for (const Layer& layer : m.layers) {
      for (auto& w : layer.weights) write_tensor(rt, w, w.tag + static_cast<uint64_t>(step));
    }
    STRATA_REQUIRE_OK(strata_step_begin(ex));
    const uint32_t flags = per_tensor ? STRATA_ACQUIRE_NO_WAIT : STRATA_ACQUIRE_DEFAULT;
    for (uint32_t l = 0; l < L; ++l) {
      const Layer& layer = m.layers[l];
      strata_layer_views_t v{};
      v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, flags, &v));
      REQUIRE(v.weight_count == layer.weights.size());
      REQUIRE(v.grad_count == 0);
      for (uint32_t i = 0; i < v.weight_count; ++i) {
        if (per_tensor) {
          STRATA_REQUIRE_OK(strata_layer_wait_tensor(ex, l, STRATA_PHASE_FORWARD,
                                                     STRATA_VIEW_WEIGHT, i, nullptr));
        }
        expect_view(v.weights[i], layer.weights[i],
                    layer.weights[i].tag + static_cast<uint64_t>(step), "forward weight");
      }
      for (uint32_t i = 0; i < v.activation_count; ++i) {
        const auto act = pattern(layer.activations[i].bytes,
                                 layer.activations[i].tag + 7 * static_cast<uint64_t>(step));
        host_to_view(v.activations[i], act.data(), act.size());
      }
      STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
    }
    for (uint32_t l = L; l-- > 0;) {
      const Layer& layer = m.layers[l];
      strata_layer_views_t v{};
      v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_BACKWARD, nullptr, flags, &v));
      if (per_tensor) {
        for (uint32_t i = 0; i < v.weight_count; ++i) {
          STRATA_REQUIRE_OK(strata_layer_wait_tensor(ex, l, STRATA_PHASE_BACKWARD,
                                                     STRATA_VIEW_WEIGHT, i, nullptr));
        }
        for (uint32_t i = 0; i < v.grad_count; ++i) {
          STRATA_REQUIRE_OK(
              strata_layer_wait_tensor(ex, l, STRATA_PHASE_BACKWARD, STRATA_VIEW_GRAD, i, nullptr));
        }
        for (uint32_t i = 0; i < v.activation_count; ++i) {
          STRATA_REQUIRE_OK(strata_layer_wait_tensor(ex, l, STRATA_PHASE_BACKWARD,
                                                     STRATA_VIEW_ACTIVATION, i, nullptr));
        }
      }
      for (uint32_t i = 0; i < v.weight_count; ++i) {
        expect_view(v.weights[i], layer.weights[i],
                    layer.weights[i].tag + static_cast<uint64_t>(step), "backward weight");
      }
      for (uint32_t i = 0; i < v.activation_count; ++i) {
        expect_view(v.activations[i], layer.activations[i],
                    layer.activations[i].tag + 7 * static_cast<uint64_t>(step),
                    "restored checkpoint");
      }
      REQUIRE(v.grad_count == layer.grads.size());
      for (uint32_t i = 0; i < v.grad_count; ++i) {
        std::vector<unsigned char> g(layer.grads[i].bytes);
        view_to_host(g.data(), v.grads[i], g.size());
        REQUIRE(std::all_of(g.begin(), g.end(), [](unsigned char b) { return b == 0; }));
        // Micro-batches accumulate into the buffer; the last one leaves the final value.
        for (uint32_t mb = 0; mb < micro_batches; ++mb) {
          const auto grad =
              pattern(g.size(), layer.grads[i].tag + 13 * static_cast<uint64_t>(step) + mb);
          host_to_view(v.grads[i], grad.data(), grad.size());
        }
      }
      STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_BACKWARD, nullptr));
    }
    STRATA_REQUIRE_OK(strata_step_end(ex));
    // The grads landed in their DRAM homes.
    for (const Layer& layer : m.layers) {
      for (auto& g : layer.grads) {
        std::vector<unsigned char> got(g.bytes);
        STRATA_REQUIRE_OK(strata_tensor_read(rt, g.handle, 0, got.data(), got.size()));
        REQUIRE(got ==
                pattern(g.bytes, g.tag + 13 * static_cast<uint64_t>(step) + micro_batches - 1));
      }
    }
  }
}

}  // namespace

TEST_CASE("randomized graphs stream every byte right, step after step", "[executor]") {
  ScratchDir scratch;
  const int trials = static_cast<int>(env_u64("STRATA_TEST_TRIALS", kDefaultTrials));
  const uint64_t seed = env_u64("STRATA_TEST_SEED", 0);
  for (int trial = 0; trial < trials; ++trial) {
    with_watchdog(120, [&] {
      std::mt19937_64 rng(static_cast<uint64_t>(trial) * 7919 + 17 + seed * 1000003);
      INFO("STRATA_TEST_SEED=" << seed << " trial " << trial);
      const bool slow = trial % 4 == 1;  // the host backend's copies at 2 GB/s
      const bool nvme = trial % 3 == 2;
      const uint64_t hbm = (24 + rng() % 96) * kMiB;
      Model m;
      build_model(m, rng, hbm, slow ? 2'000'000'000ull : 0, nvme, scratch);
      strata_plan_config_t pc;
      strata_plan_config_init(&pc);
      pc.micro_batches = 1 + static_cast<uint32_t>(rng() % 3);
      pc.chunk_bytes = 4 * kMiB;
      strata_plan_t* plan = nullptr;
      const strata_status_t s = strata_plan_create(m.graph, &pc, &plan);
      INFO("trial " << trial << ": " << strata_last_error_message());
      if (s == STRATA_ERROR_OUT_OF_MEMORY) return;  // the random budget was too small: fine
      REQUIRE(s == STRATA_OK);
      strata_plan_info_t info{};
      info.struct_size = STRATA_PLAN_INFO_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_plan_get_info(plan, &info));
      REQUIRE(info.slots >= 1);
      REQUIRE(info.predicted_step_seconds >= 0);
      strata_executor_t* ex = nullptr;
      STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
      strata_plan_destroy(plan);
      run_steps(m, ex, 3, pc.micro_batches, trial % 5 == 3);
      strata_executor_stats_t st{};
      st.struct_size = STRATA_EXECUTOR_STATS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_executor_get_stats(ex, &st));
      REQUIRE(st.steps == 3);
      REQUIRE(st.loads == 3 * 2 * m.layers.size());
      REQUIRE(st.reused_loads >= 3);  // at least the turnaround layer, every step
      STRATA_REQUIRE_OK(strata_executor_destroy(ex));
    });
  }
}

TEST_CASE("a tight budget still streams with two slots", "[executor]") {
  with_watchdog(120, [&] {
    ScratchDir scratch;
    std::mt19937_64 rng(5);
    Model m;
    build_model(m, rng, 64 * kMiB, 0, false, scratch);
    strata_plan_config_t pc;
    strata_plan_config_init(&pc);
    strata_plan_t* plan = nullptr;
    STRATA_REQUIRE_OK(strata_plan_create(m.graph, &pc, &plan));
    strata_plan_info_t info{};
    info.struct_size = STRATA_PLAN_INFO_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_plan_get_info(plan, &info));
    strata_plan_destroy(plan);
    pc.hbm_slot_budget_bytes = 2 * info.slot_bytes;  // exactly two slots
    STRATA_REQUIRE_OK(strata_plan_create(m.graph, &pc, &plan));
    STRATA_REQUIRE_OK(strata_plan_get_info(plan, &info));
    REQUIRE(info.slots == std::min<uint32_t>(2, static_cast<uint32_t>(m.layers.size())));
    strata_executor_t* ex = nullptr;
    STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
    strata_plan_destroy(plan);
    run_steps(m, ex, 2, 1, false);
    strata_executor_destroy(ex);
  });
}

TEST_CASE("misuse gets a clear error, never a hang", "[executor]") {
  with_watchdog(60, [&] {
    RuntimePtr rt = make_runtime(config_for(backend_under_test(), 64 * kMiB, 64 * kMiB));
    std::vector<strata_tensor_t*> w;
    for (int l = 0; l < 3; ++l)
      w.push_back(register_bytes(rt.get(), "w" + std::to_string(l), 4 * kMiB, STRATA_TIER_DRAM));
    strata_tensor_t* grad = register_bytes(rt.get(), "g0", 4 * kMiB, STRATA_TIER_DRAM);
    strata_tensor_t* in_hbm = register_bytes(rt.get(), "hbm", 1024, STRATA_TIER_HBM);
    strata_graph_t* g = nullptr;
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &g));
    for (int l = 0; l < 3; ++l) {
      strata_layer_desc_t d{};
      d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
      d.weights = &w[static_cast<std::size_t>(l)];
      d.weight_count = 1;
      if (l == 0) {
        d.grads = &grad;
        d.grad_count = 1;
      }
      STRATA_REQUIRE_OK(strata_graph_add_layer(g, &d, nullptr));
    }
    // Graph-level errors.
    strata_layer_desc_t empty{};
    empty.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    STRATA_REQUIRE_ERROR(strata_graph_add_layer(g, &empty, nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                         "no weights");
    empty.weight_count = 2;
    STRATA_REQUIRE_ERROR(strata_graph_add_layer(g, &empty, nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                         "NULL");
    STRATA_REQUIRE_ERROR(strata_graph_add_layer(nullptr, &empty, nullptr),
                         STRATA_ERROR_INVALID_ARGUMENT, "graph");

    strata_plan_config_t pc;
    strata_plan_config_init(&pc);
    pc.hbm_slot_budget_bytes = 5 * kMiB;  // less than two 4 MiB slots
    strata_plan_t* plan = nullptr;
    STRATA_REQUIRE_ERROR(strata_plan_create(g, &pc, &plan), STRATA_ERROR_OUT_OF_MEMORY, "short by");
    pc.hbm_slot_budget_bytes = 1ull << 40;
    STRATA_REQUIRE_ERROR(strata_plan_create(g, &pc, &plan), STRATA_ERROR_OUT_OF_MEMORY, "exceeds");
    pc.hbm_slot_budget_bytes = 0;
    pc.chunk_bytes = 1024;
    STRATA_REQUIRE_ERROR(strata_plan_create(g, &pc, &plan), STRATA_ERROR_INVALID_ARGUMENT, "4 MiB");
    strata_plan_config_init(&pc);

    // A tensor declared twice, and a weight in HBM.
    strata_graph_t* bad = nullptr;
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &bad));
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = &w[0];
    d.weight_count = 1;
    STRATA_REQUIRE_OK(strata_graph_add_layer(bad, &d, nullptr));
    STRATA_REQUIRE_OK(strata_graph_add_layer(bad, &d, nullptr));
    STRATA_REQUIRE_ERROR(strata_plan_create(bad, &pc, &plan), STRATA_ERROR_INVALID_ARGUMENT,
                         "declared twice");
    strata_graph_destroy(bad);
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &bad));
    d.weights = &in_hbm;
    STRATA_REQUIRE_OK(strata_graph_add_layer(bad, &d, nullptr));
    STRATA_REQUIRE_ERROR(strata_plan_create(bad, &pc, &plan), STRATA_ERROR_INVALID_ARGUMENT,
                         "lives in hbm");
    strata_graph_destroy(bad);
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &bad));
    STRATA_REQUIRE_ERROR(strata_plan_create(bad, &pc, &plan), STRATA_ERROR_INVALID_ARGUMENT,
                         "no layers");
    strata_graph_destroy(bad);

    STRATA_REQUIRE_OK(strata_plan_create(g, &pc, &plan));
    size_t len = 0;
    STRATA_REQUIRE_OK(strata_plan_dump(plan, STRATA_PLAN_FORMAT_JSON, nullptr, 0, &len));
    std::string json(len + 1, '\0');
    STRATA_REQUIRE_OK(
        strata_plan_dump(plan, STRATA_PLAN_FORMAT_JSON, json.data(), json.size(), &len));
    REQUIRE_THAT(json, Catch::Contains("\"slots\"") && Catch::Contains("\"predicted\"") &&
                           Catch::Contains("\"bottleneck\"") && Catch::Contains("\"homes\""));
    char small[8];
    STRATA_REQUIRE_ERROR(
        strata_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, small, sizeof small, nullptr),
        STRATA_ERROR_INVALID_ARGUMENT, "too small");
    STRATA_REQUIRE_ERROR(strata_plan_dump(plan, 7, nullptr, 0, &len), STRATA_ERROR_INVALID_ARGUMENT,
                         "format 7");

    strata_executor_t* ex = nullptr;
    STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
    strata_plan_destroy(plan);
    STRATA_REQUIRE_ERROR(strata_tensor_unregister(rt.get(), w[1]), STRATA_ERROR_BUSY, "executor");
    STRATA_REQUIRE_ERROR(strata_tensor_move(rt.get(), w[1], STRATA_TIER_HBM, nullptr, nullptr),
                         STRATA_ERROR_BUSY, "executor");
    strata_layer_views_t v{};
    v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 0, STRATA_PHASE_FORWARD, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_STATE, "outside a step");
    STRATA_REQUIRE_ERROR(strata_step_end(ex), STRATA_ERROR_INVALID_STATE, "without step_begin");
    STRATA_REQUIRE_OK(strata_step_begin(ex));
    STRATA_REQUIRE_ERROR(strata_step_begin(ex), STRATA_ERROR_INVALID_STATE, "inside a step");
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 1, STRATA_PHASE_FORWARD, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_STATE, "layer 0 (forward) is next");
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 0, STRATA_PHASE_BACKWARD, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_STATE, "out of order");
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 9, STRATA_PHASE_FORWARD, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_ARGUMENT, "declares 3 layers");
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 0, 5, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_ARGUMENT, "phase 5");
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 0, STRATA_PHASE_FORWARD, nullptr, 8, &v),
                         STRATA_ERROR_INVALID_ARGUMENT, "flags 8");
    STRATA_REQUIRE_ERROR(strata_layer_release(ex, 0, STRATA_PHASE_FORWARD, nullptr),
                         STRATA_ERROR_INVALID_STATE, "without a matching acquire");
    STRATA_REQUIRE_OK(strata_layer_acquire(ex, 0, STRATA_PHASE_FORWARD, nullptr, 0, &v));
    STRATA_REQUIRE_ERROR(strata_layer_acquire(ex, 0, STRATA_PHASE_FORWARD, nullptr, 0, &v),
                         STRATA_ERROR_INVALID_STATE, "already acquired");
    STRATA_REQUIRE_ERROR(
        strata_layer_wait_tensor(ex, 0, STRATA_PHASE_FORWARD, STRATA_VIEW_WEIGHT, 3, nullptr),
        STRATA_ERROR_INVALID_ARGUMENT, "out of range");
    STRATA_REQUIRE_ERROR(strata_layer_release(ex, 1, STRATA_PHASE_FORWARD, nullptr),
                         STRATA_ERROR_INVALID_STATE, "out of order");
    STRATA_REQUIRE_ERROR(strata_step_end(ex), STRATA_ERROR_INVALID_STATE,
                         "acquired and not released");
    STRATA_REQUIRE_OK(strata_layer_release(ex, 0, STRATA_PHASE_FORWARD, nullptr));
    STRATA_REQUIRE_ERROR(strata_layer_release(ex, 0, STRATA_PHASE_FORWARD, nullptr),
                         STRATA_ERROR_INVALID_STATE, "released twice");
    STRATA_REQUIRE_ERROR(strata_step_end(ex), STRATA_ERROR_INVALID_STATE, "still to run");
    // Destroying an executor mid-step is allowed: it waits for its copies and lets go.
    STRATA_REQUIRE_OK(strata_executor_destroy(ex));
    STRATA_REQUIRE_OK(strata_tensor_unregister(rt.get(), w[1]));
    strata_graph_destroy(g);
  });
}

TEST_CASE("a backward load zeroes grad homes, and keeps an optimizer's in-place sums it holds",
          "[executor][grad_sum]") {
  // One layer, two f32 grads in HBM homes: g0 an explicit-mode optimizer's in-place gradient
  // sum (STRATA_GRAD_SUM_IN_PLACE), g1 a plain grad home (summed in an accumulator). A slowed
  // link: an acquire that did not wait for a home's zero fill would see the pattern still there.
  with_watchdog(60, [&] {
    RuntimePtr rt =
        make_runtime(config_for(backend_under_test(), 16 * kMiB, 64 * kMiB,
                                backend_under_test() == STRATA_DEVICE_BACKEND_HOST ? 4 * kMiB : 0));
    constexpr std::size_t n = 4096;
    auto reg = [&](const char* name, strata_tier_t tier, strata_dtype_t dtype, strata_role_t role) {
      const int64_t shape[1] = {static_cast<int64_t>(n)};
      const strata_tensor_desc_t d = desc(name, shape, 1, tier, dtype, role);
      strata_tensor_t* t = nullptr;
      STRATA_REQUIRE_OK(strata_tensor_register(rt.get(), &d, &t));
      return t;
    };
    strata_tensor_t* w[2] = {reg("w0", STRATA_TIER_DRAM, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT),
                             reg("w1", STRATA_TIER_DRAM, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT)};
    strata_tensor_t* g[2] = {reg("g0", STRATA_TIER_HBM, STRATA_DTYPE_F32, STRATA_ROLE_GRAD),
                             reg("g1", STRATA_TIER_HBM, STRATA_DTYPE_F32, STRATA_ROLE_GRAD)};
    strata_graph_t* graph = nullptr;
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &graph));
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = w;
    d.weight_count = 2;
    d.grads = g;
    d.grad_count = 2;
    STRATA_REQUIRE_OK(strata_graph_add_layer(graph, &d, nullptr));
    strata_plan_config_t pc;
    STRATA_REQUIRE_OK(strata_plan_config_init(&pc));
    pc.h2d_bytes_per_second = 1e9;
    pc.d2h_bytes_per_second = 1e9;
    strata_plan_t* plan = nullptr;
    STRATA_REQUIRE_OK(strata_plan_create(graph, &pc, &plan));
    strata_executor_t* ex = nullptr;
    STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
    strata_optimizer_config_t oc;
    STRATA_REQUIRE_OK(strata_optimizer_config_init(STRATA_OPTIMIZER_SGD, &oc));
    oc.update_mode = STRATA_UPDATE_EXPLICIT;
    oc.threads = 1;
    strata_optimizer_t* opt = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &oc, &opt));
    for (int k = 0; k < 2; ++k) {
      strata_param_desc_t p{};
      p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
      p.weight = w[k];
      p.grad = g[k];
      p.grad_sum = k == 0 ? STRATA_GRAD_SUM_IN_PLACE : STRATA_GRAD_SUM_ACCUMULATOR;
      STRATA_REQUIRE_OK(strata_optimizer_add_param(opt, &p));
    }
    STRATA_REQUIRE_OK(strata_optimizer_attach(opt, ex));

    std::vector<float> pattern[2], zeros(n, 0.f), seen(n);
    for (int k = 0; k < 2; ++k) {
      for (std::size_t i = 0; i < n; ++i) pattern[k].push_back(static_cast<float>(k * n + i + 1));
    }
    strata_layer_views_t v{};
    v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
    // One step; `check` sees the grad views at the backward acquire.
    auto step = [&](const std::function<void()>& check) {
      STRATA_REQUIRE_OK(strata_step_begin(ex));
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, 0, STRATA_PHASE_FORWARD, nullptr, 0, &v));
      STRATA_REQUIRE_OK(strata_layer_release(ex, 0, STRATA_PHASE_FORWARD, nullptr));
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, 0, STRATA_PHASE_BACKWARD, nullptr, 0, &v));
      check();
      STRATA_REQUIRE_OK(strata_layer_release(ex, 0, STRATA_PHASE_BACKWARD, nullptr));
      STRATA_REQUIRE_OK(strata_step_end(ex));
    };
    auto view_is = [&](int k, const std::vector<float>& want) {
      view_to_host(seen.data(), v.grads[k], n * sizeof(float));
      return seen == want;
    };
    step([&] {  // nothing held: both zeroed; the framework writes the patterns
      REQUIRE(view_is(0, zeros));
      REQUIRE(view_is(1, zeros));
      for (int k = 0; k < 2; ++k) host_to_view(v.grads[k], pattern[k].data(), n * sizeof(float));
    });
    step([&] {  // the sum holds its pattern; the grad buffer home was zeroed
      REQUIRE(view_is(0, pattern[0]));
      REQUIRE(view_is(1, zeros));
      // A copy would replace the sum: refused; the plain home takes one.
      STRATA_REQUIRE_ERROR(strata_layer_write_view(ex, 0, STRATA_PHASE_BACKWARD, STRATA_VIEW_GRAD,
                                                   0, zeros.data(), n * sizeof(float)),
                           STRATA_ERROR_INVALID_STATE, "'g0' of layer 0 is an in-place");
      STRATA_REQUIRE_OK(strata_layer_write_view(ex, 0, STRATA_PHASE_BACKWARD, STRATA_VIEW_GRAD, 1,
                                                pattern[1].data(), n * sizeof(float)));
      // No copy into the kept sum: nothing to wait for, and waiting says so.
      STRATA_REQUIRE_OK(
          strata_layer_wait_tensor(ex, 0, STRATA_PHASE_BACKWARD, STRATA_VIEW_GRAD, 0, nullptr));
    });
    STRATA_REQUIRE_OK(strata_optimizer_grad_zero(opt, w[0], 1));  // zeros: not held any more
    step([&] {
      REQUIRE(view_is(0, zeros));
      REQUIRE(view_is(1, zeros));
    });
    STRATA_REQUIRE_OK(strata_optimizer_destroy(opt));
    STRATA_REQUIRE_OK(strata_executor_destroy(ex));
    STRATA_REQUIRE_OK(strata_plan_destroy(plan));
    STRATA_REQUIRE_OK(strata_graph_destroy(graph));
  });
}

int main(int argc, char** argv) {
  return run_on_backend_under_test(argc, argv);
}
