// strata-bench stream: a synthetic layer graph streamed by the executor, with a busy kernel
// standing in for compute (a sleeping thread on the host backend). For each graph it reports
// the achieved H2D rate against the link ceiling measured in the same run (cudaMemcpyAsync of
// one layer between the same kind of buffers), how long the compute stream waited for data,
// and the planner's predicted step time next to the measured one.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_options.h"
#include "bench_report.h"
#include "bench_strata.h"
#include "busy_compute.h"
#include "device_peer.h"
#include "strata/strata.h"

namespace strata_bench {
namespace {

using Clock = std::chrono::steady_clock;

struct GraphResult {
  double step_seconds = 0;
  double predicted_seconds = 0;
  double wait_seconds = 0;
  double compute_seconds = 0;
  double bytes_in = 0;
  double bytes_out = 0;
  std::string bottleneck;
  uint32_t slots = 0, depth = 0;
  double update_seconds = 0;  // optimizer pool time per step
  uint32_t optimizer_threads = 0;
};

// One graph: `layers` layers of 4 weight tensors (and grads if asked), compute per layer and
// pass = ratio x the layer's transfer time at `ceiling`.
GraphResult run_graph(strata_runtime_t* rt, bool cuda, int layers, uint64_t layer_bytes, bool grads,
                      double ratio, double ceiling, int steps, uint64_t slot_budget,
                      const std::string& tag, bool optim = false) {
  strata_graph_t* graph = nullptr;
  check(strata_graph_create(rt, &graph), "graph");
  std::vector<strata_tensor_t*> all;
  const double compute_ns = ratio * static_cast<double>(layer_bytes) / ceiling * 1e9;
  const double nominal_flops = 1e12;  // compute given as time: flops = seconds x this rate
  for (int l = 0; l < layers; ++l) {
    std::vector<strata_tensor_t*> w, g;
    for (int i = 0; i < 4; ++i) {
      w.push_back(make_tensor(rt, tag + ".l" + std::to_string(l) + ".w" + std::to_string(i),
                              layer_bytes / 4, STRATA_TIER_DRAM, true));
    }
    if (grads) {
      for (int i = 0; i < 4; ++i) {
        g.push_back(make_tensor(rt, tag + ".l" + std::to_string(l) + ".g" + std::to_string(i),
                                layer_bytes / 4, STRATA_TIER_DRAM, true));
      }
    }
    all.insert(all.end(), w.begin(), w.end());
    all.insert(all.end(), g.begin(), g.end());
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = w.data();
    d.weight_count = 4;
    d.grads = g.data();
    d.grad_count = static_cast<uint32_t>(g.size());
    d.forward_flops = compute_ns * 1e-9 * nominal_flops;
    d.backward_flops = d.forward_flops;
    check(strata_graph_add_layer(graph, &d, nullptr), "add layer");
  }
  strata_plan_config_t pc;
  strata_plan_config_init(&pc);
  pc.device_flops_per_second = nominal_flops;
  pc.hbm_slot_budget_bytes = slot_budget;
  strata_plan_t* plan = nullptr;
  check(strata_plan_create(graph, &pc, &plan), "plan");
  strata_plan_info_t info{};
  info.struct_size = STRATA_PLAN_INFO_STRUCT_SIZE;
  check(strata_plan_get_info(plan, &info), "plan info");
  size_t len = 0;
  check(strata_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &len), "dump");
  std::string text(len + 1, '\0');
  check(strata_plan_dump(plan, STRATA_PLAN_FORMAT_TEXT, text.data(), text.size(), &len), "dump");
  std::fprintf(stderr, "%s", text.c_str());
  strata_executor_t* ex = nullptr;
  check(strata_executor_create(plan, &ex), "executor");
  strata_optimizer_t* opt = nullptr;
  if (optim) {
    // AdamW on every weight: fp32 masters, m and v in DRAM, each layer's update as its grads
    // land, the next step's load of the layer after its update.
    check(strata_optimizer_create(rt, nullptr, &opt), "optimizer");
    for (std::size_t i = 0; i + 1 < all.size(); i += 8) {
      for (std::size_t k = 0; k < 4; ++k) {
        strata_param_desc_t p{
            STRATA_PARAM_DESC_STRUCT_SIZE, all[i + k], all[i + 4 + k], 0, STRATA_MASTER_SEPARATE,
            STRATA_GRAD_SUM_ACCUMULATOR};
        check(strata_optimizer_add_param(opt, &p), "add_param");
      }
    }
    check(strata_optimizer_attach(opt, ex), "attach");
  }

  void* stream = stream_create(cuda);
  std::vector<StreamTimer> waits(static_cast<std::size_t>(2 * layers));
  for (auto& t : waits) timer_create(cuda, &t);
  std::vector<double> step_times, wait_times;
  strata_executor_stats_t before{}, after{};
  before.struct_size = after.struct_size = STRATA_EXECUTOR_STATS_STRUCT_SIZE;
  const int warmup = 1;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) check(strata_executor_get_stats(ex, &before), "stats");
    const auto start = Clock::now();
    check(strata_step_begin(ex), "step_begin");
    std::size_t k = 0;
    for (int pass = 0; pass < 2; ++pass) {
      const strata_phase_t phase = pass == 0 ? STRATA_PHASE_FORWARD : STRATA_PHASE_BACKWARD;
      for (int i = 0; i < layers; ++i) {
        const uint32_t l = static_cast<uint32_t>(pass == 0 ? i : layers - 1 - i);
        strata_layer_views_t v{};
        v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
        StreamTimer& t = waits[k++];
        timer_mark(cuda, stream, t.start);
        check(strata_layer_acquire(ex, l, phase, stream, STRATA_ACQUIRE_DEFAULT, &v), "acquire");
        timer_mark(cuda, stream, t.end);
        if (compute_ns > 0 && !busy_compute(cuda, stream, static_cast<uint64_t>(compute_ns))) {
          throw std::runtime_error("busy kernel launch failed");
        }
        check(strata_layer_release(ex, l, phase, stream), "release");
      }
    }
    check(strata_step_end(ex), "step_end");
    stream_synchronize(cuda, stream);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (step >= warmup) {
      step_times.push_back(seconds);
      double wait = 0;
      for (auto& t : waits) wait += timer_seconds(cuda, t);
      wait_times.push_back(wait);
    }
    progress(tag + " step " + std::to_string(step + 1) + "/" + std::to_string(warmup + steps) +
             ": " + std::to_string(seconds * 1e3) + " ms");
  }
  check(strata_executor_get_stats(ex, &after), "stats");
  GraphResult r;
  if (opt != nullptr) {
    strata_optimizer_stats_t os{};
    os.struct_size = STRATA_OPTIMIZER_STATS_STRUCT_SIZE;
    check(strata_optimizer_get_stats(opt, &os), "optimizer stats");
    r.update_seconds = os.update_seconds / (warmup + steps);
    r.optimizer_threads = os.threads;
    check(strata_optimizer_destroy(opt), "optimizer destroy");
  }
  for (auto& t : waits) timer_destroy(cuda, &t);
  stream_destroy(cuda, stream);
  check(strata_executor_destroy(ex), "executor destroy");
  check(strata_plan_destroy(plan), "plan destroy");
  check(strata_graph_destroy(graph), "graph destroy");
  for (auto* t : all) check(strata_tensor_unregister(rt, t), "unregister");

  r.step_seconds = median(step_times);
  r.wait_seconds = median(wait_times);
  r.predicted_seconds = info.predicted_step_seconds;
  r.compute_seconds = 2.0 * layers * compute_ns * 1e-9;
  r.bytes_in = static_cast<double>(after.bytes_in - before.bytes_in) / steps;
  r.bytes_out = static_cast<double>(after.bytes_out - before.bytes_out) / steps;
  r.bottleneck = info.bottleneck;
  r.slots = info.slots;
  r.depth = info.forward_prefetch_depth;
  return r;
}

// Measured step time next to the prediction; ratio = min / max, 1 = exact agreement.
Result agreement(const std::string& metric, const GraphResult& g, const std::string& note) {
  Result r;
  r.metric = metric;
  r.value = g.step_seconds;
  r.unit = "s";
  r.baseline = "planner prediction";
  r.baseline_value = g.predicted_seconds;
  r.ratio =
      std::min(g.step_seconds, g.predicted_seconds) / std::max(g.step_seconds, g.predicted_seconds);
  r.note = note;
  return r;
}

}  // namespace

int run_stream(const Options& opt, Report* report) {
  const int layers = static_cast<int>(opt.integer("layers", 24));
  const uint64_t layer_bytes = opt.bytes("layer-bytes", 256ull << 20);
  const int steps = static_cast<int>(opt.integer("steps", 3));
  const uint64_t slot_budget = opt.bytes("slot-budget", 0);
  const std::string backend = opt.str("backend", "auto");
  const double compute_ratio = std::strtod(opt.str("compute-ratio", "1.2").c_str(), nullptr);
  const bool grads = opt.flag("grads");
  const std::string trace = opt.str("trace", "");
  const bool optim = opt.flag("optim");
  if (optim && !grads) throw std::invalid_argument("--optim needs --grads");
  if (layers < 2 || steps < 1 || layer_bytes < (4u << 20)) {
    throw std::invalid_argument("--layers >= 2, --steps >= 1, --layer-bytes >= 4M");
  }
  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = backend_from(backend);
  const uint64_t model = static_cast<uint64_t>(layers) * layer_bytes * (grads ? 2 : 1);
  // With --optim: fp32 master, m and v for every bf16 weight (12 bytes per 2).
  c.dram_budget_bytes =
      model + (optim ? 6ull * layers * layer_bytes : 0) + 2 * layer_bytes + (256ull << 20);
  c.hbm_budget_bytes = slot_budget != 0 ? slot_budget + 2 * layer_bytes + (256ull << 20)
                                        : 8 * layer_bytes * (grads ? 2 : 1) + (512ull << 20);
  strata_capabilities_t caps;
  strata_runtime_t* rt = open_runtime(c, &caps);
  const bool cuda = caps.device_backend == STRATA_DEVICE_BACKEND_CUDA;
  report->device = std::string(caps.device_name) + " (" +
                   strata_device_backend_name(caps.device_backend) + " backend)";

  // The link ceiling, this run: plain copies of one layer between pinned DRAM and HBM.
  progress("measuring the link ceiling");
  strata_tensor_t* host_a = make_tensor(rt, "ceiling.h", layer_bytes, STRATA_TIER_DRAM, true);
  strata_tensor_t* dev_a = make_tensor(rt, "ceiling.d", layer_bytes, STRATA_TIER_HBM, true);
  void *h = nullptr, *d = nullptr;
  check(strata_tensor_data_pointer(rt, host_a, &h), "pointer");
  check(strata_tensor_data_pointer(rt, dev_a, &d), "pointer");
  CopyTimes peer;
  std::string error;
  if (!time_peer_copies(cuda, caps.device_ordinal, h, d, h, d, layer_bytes, 5, &peer, &error)) {
    throw std::runtime_error("ceiling copies failed: " + error);
  }
  check(strata_tensor_unregister(rt, host_a), "unregister");
  check(strata_tensor_unregister(rt, dev_a), "unregister");
  const double ceiling = static_cast<double>(layer_bytes) / peer.h2d_seconds;
  const std::string peer_name = cuda ? "cudaMemcpyAsync h2d" : "memcpy (1 thread)";

  // Transfer-bound: no compute at all; the step is as fast as H2D can stream the weights.
  progress("transfer-bound graph");
  const GraphResult t =
      run_graph(rt, cuda, layers, layer_bytes, grads, 0.0, ceiling, steps, slot_budget, "transfer");
  report->add_vs("transfer_bound_h2d", t.bytes_in / t.step_seconds / 1e9, "GB/s", peer_name,
                 ceiling / 1e9, false,
                 std::to_string(t.slots) + " slots, depth " + std::to_string(t.depth));
  report->add(agreement("transfer_bound_step", t, "bottleneck " + t.bottleneck));

  // Compute-bound: each layer's compute is compute_ratio x its transfer time.
  progress("compute-bound graph (compute " + std::to_string(compute_ratio) + "x transfer)");
  const GraphResult k = run_graph(rt, cuda, layers, layer_bytes, grads, compute_ratio, ceiling,
                                  steps, slot_budget, "compute");
  report->add(Result{"compute_bound_gpu_wait", 100.0 * k.wait_seconds / k.step_seconds, "%", "", 0,
                     0, "of the step the compute stream waited for data"});
  report->add_vs("compute_bound_busy", k.compute_seconds / k.step_seconds, "frac",
                 "all compute, no waiting", 1.0, false, "bottleneck " + k.bottleneck);
  report->add(agreement("compute_bound_step", k, ""));
  GraphResult optimized;
  if (optim) {
    // The same compute-bound graph with the optimizer: what the updates add to the step.
    progress("compute-bound graph with AdamW");
    optimized = run_graph(rt, cuda, layers, layer_bytes, grads, compute_ratio, ceiling, steps,
                          slot_budget, "optim", true);
    char note[160];
    std::snprintf(note, sizeof note, "update %.3f s/step on %u threads, compute %.3f s/step",
                  optimized.update_seconds, optimized.optimizer_threads, optimized.compute_seconds);
    report->add_vs("compute_bound_step_with_adamw", optimized.step_seconds, "s",
                   "same step without", k.step_seconds, true, note);
  }
  if (!trace.empty()) {
    // The same compute-bound graph again with tracing on (with the optimizer, if asked for):
    // the overhead, and the trace file.
    progress("compute-bound graph, traced");
    check(strata_trace_start(rt, nullptr), "trace start");
    const GraphResult traced = run_graph(rt, cuda, layers, layer_bytes, grads, compute_ratio,
                                         ceiling, steps, slot_budget, "traced", optim);
    check(strata_trace_stop(rt), "trace stop");
    check(strata_trace_flush(rt, trace.c_str()), "trace flush");
    strata_trace_counters_t tc{};
    tc.struct_size = STRATA_TRACE_COUNTERS_STRUCT_SIZE;
    check(strata_trace_get_counters(rt, &tc), "trace counters");
    report->add_vs("traced_compute_bound_step", traced.step_seconds, "s", "untraced",
                   optim ? optimized.step_seconds : k.step_seconds, true,
                   std::to_string(tc.dropped) + " records dropped; " + trace);
  }
  check(strata_runtime_destroy(rt), "destroy");
  return 0;
}

}  // namespace strata_bench
