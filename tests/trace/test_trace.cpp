// Tracing through the C ABI: the trace holds what ran (counts and bytes match the runtime's own
// counters), survives full rings by dropping, and costs nothing when off. Leaves a trace file
// (and its counters) for the strata-prof tests: $STRATA_TRACE_OUT, default strata-trace-test.json.
#define CATCH_CONFIG_MAIN
#include <cstdio>
#include <fstream>

#include "support/test_support.h"

using namespace strata_test;

namespace {
constexpr uint64_t kMiB = 1ull << 20;

std::string out_path() {
  const char* env = std::getenv("STRATA_TRACE_OUT");
  return env != nullptr ? env : "strata-trace-test.json";
}

strata_trace_counters_t counters(strata_runtime_t* rt) {
  strata_trace_counters_t c{};
  c.struct_size = STRATA_TRACE_COUNTERS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_trace_get_counters(rt, &c));
  return c;
}

uint64_t link_bytes(strata_runtime_t* rt, strata_link_t link) {
  strata_link_stats_t s{};
  s.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt, link, &s));
  return s.bytes;
}
}  // namespace

TEST_CASE("a trace holds what ran: moves, copies, NVMe requests, acquires", "[trace]") {
  ScratchDir scratch;
  const std::string file = scratch.file("nvme");
  const char* paths[1] = {file.c_str()};
  strata_runtime_config_t c = config_for(STRATA_DEVICE_BACKEND_HOST, 64 * kMiB, 64 * kMiB);
  c.nvme_paths = paths;
  c.nvme_path_count = 1;
  c.nvme_budget_bytes = 64 * kMiB;
  RuntimePtr rt = make_runtime(c);
  strata_runtime_t* r = rt.get();

  // Off by default: nothing is recorded.
  strata_tensor_t* t = register_bytes(r, "moved", 3 * kMiB + 5, STRATA_TIER_DRAM);
  strata_event_t* e = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_move(r, t, STRATA_TIER_HBM, nullptr, &e));
  STRATA_REQUIRE_OK(strata_event_wait(e, -1));
  strata_event_destroy(e);
  REQUIRE(counters(r).records[STRATA_TRACE_MIGRATION] == 0);

  STRATA_REQUIRE_OK(strata_runtime_reset_stats(r));
  STRATA_REQUIRE_OK(strata_trace_start(r, nullptr));
  const strata_tier_t route[] = {STRATA_TIER_DRAM, STRATA_TIER_NVME, STRATA_TIER_HBM,
                                 STRATA_TIER_NVME, STRATA_TIER_DRAM};
  for (strata_tier_t dst : route) {
    STRATA_REQUIRE_OK(strata_tensor_move(r, t, dst, nullptr, &e));
    STRATA_REQUIRE_OK(strata_event_wait(e, -1));
    strata_event_destroy(e);
  }
  // One executor step over two layers.
  std::vector<strata_tensor_t*> w = {register_bytes(r, "w0", 2 * kMiB, STRATA_TIER_DRAM),
                                     register_bytes(r, "w1", 2 * kMiB, STRATA_TIER_DRAM)};
  strata_graph_t* g = nullptr;
  STRATA_REQUIRE_OK(strata_graph_create(r, &g));
  for (auto*& weight : w) {
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = &weight;
    d.weight_count = 1;
    STRATA_REQUIRE_OK(strata_graph_add_layer(g, &d, nullptr));
  }
  strata_plan_t* plan = nullptr;
  strata_plan_config_t pc;
  strata_plan_config_init(&pc);
  pc.h2d_bytes_per_second = pc.d2h_bytes_per_second = 1e9;  // no measurement copies in the trace
  STRATA_REQUIRE_OK(strata_plan_create(g, &pc, &plan));
  strata_executor_t* ex = nullptr;
  STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
  STRATA_REQUIRE_OK(strata_step_begin(ex));
  for (int pass = 0; pass < 2; ++pass) {
    for (uint32_t i = 0; i < 2; ++i) {
      const uint32_t l = pass == 0 ? i : 1 - i;
      const strata_phase_t ph = pass == 0 ? STRATA_PHASE_FORWARD : STRATA_PHASE_BACKWARD;
      strata_layer_views_t v{};
      v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, ph, nullptr, 0, &v));
      STRATA_REQUIRE_OK(strata_layer_release(ex, l, ph, nullptr));
    }
  }
  STRATA_REQUIRE_OK(strata_step_end(ex));
  strata_executor_destroy(ex);
  strata_plan_destroy(plan);
  strata_graph_destroy(g);

  const strata_trace_counters_t tc = counters(r);
  REQUIRE(tc.records[STRATA_TRACE_MIGRATION] == 5);
  REQUIRE(tc.bytes[STRATA_TRACE_MIGRATION] == 5 * (3 * kMiB + 5));
  REQUIRE(tc.records[STRATA_TRACE_ACQUIRE] == 4);
  REQUIRE(tc.records[STRATA_TRACE_RELEASE] == 4);
  // Copies and NVMe requests: exactly what the link counters saw.
  REQUIRE(tc.bytes[STRATA_TRACE_COPY_H2D] == link_bytes(r, STRATA_LINK_H2D));
  REQUIRE(tc.bytes[STRATA_TRACE_COPY_D2H] == link_bytes(r, STRATA_LINK_D2H));
  REQUIRE(tc.bytes[STRATA_TRACE_NVME_READ] == link_bytes(r, STRATA_LINK_NVME_READ));
  REQUIRE(tc.bytes[STRATA_TRACE_NVME_WRITE] == link_bytes(r, STRATA_LINK_NVME_WRITE));
  REQUIRE(tc.bytes[STRATA_TRACE_COPY_H2D] > 0);
  REQUIRE(tc.bytes[STRATA_TRACE_NVME_READ] > 0);
  REQUIRE(tc.dropped == 0);

  const std::string path = out_path();
  STRATA_REQUIRE_OK(strata_trace_flush(r, path.c_str()));
  std::ofstream side(path + ".counters.json");
  side << "{\"copy_h2d\": " << tc.bytes[STRATA_TRACE_COPY_H2D]
       << ", \"copy_d2h\": " << tc.bytes[STRATA_TRACE_COPY_D2H]
       << ", \"nvme_read\": " << tc.bytes[STRATA_TRACE_NVME_READ]
       << ", \"nvme_write\": " << tc.bytes[STRATA_TRACE_NVME_WRITE]
       << ", \"migrations\": " << tc.records[STRATA_TRACE_MIGRATION]
       << ", \"acquires\": " << tc.records[STRATA_TRACE_ACQUIRE] << "}\n";
  STRATA_REQUIRE_OK(strata_trace_stop(r));
  STRATA_REQUIRE_ERROR(strata_trace_flush(r, "/nonexistent-dir/x.json"), STRATA_ERROR_IO,
                       "nonexistent");
}

TEST_CASE("full rings drop records instead of blocking", "[trace]") {
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 16 * kMiB, 16 * kMiB));
  strata_trace_config_t tc{};
  tc.struct_size = STRATA_TRACE_CONFIG_STRUCT_SIZE;
  tc.ring_capacity = 2;
  STRATA_REQUIRE_OK(strata_trace_start(rt.get(), &tc));
  strata_tensor_t* t = register_bytes(rt.get(), "x", 4096, STRATA_TIER_DRAM);
  for (int i = 0; i < 10; ++i) {
    strata_event_t* e = nullptr;
    STRATA_REQUIRE_OK(strata_tensor_move(
        rt.get(), t, i % 2 == 0 ? STRATA_TIER_HBM : STRATA_TIER_DRAM, nullptr, &e));
    STRATA_REQUIRE_OK(strata_event_wait(e, -1));
    strata_event_destroy(e);
  }
  const strata_trace_counters_t c = counters(rt.get());
  REQUIRE(c.dropped > 0);
  REQUIRE(c.records[STRATA_TRACE_MIGRATION] + c.records[STRATA_TRACE_COPY_H2D] +
              c.records[STRATA_TRACE_COPY_D2H] + c.dropped ==
          20);
  STRATA_REQUIRE_ERROR(strata_trace_start(nullptr, nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "runtime");
  tc.struct_size = 1;
  STRATA_REQUIRE_ERROR(strata_trace_start(rt.get(), &tc), STRATA_ERROR_INVALID_ARGUMENT,
                       "struct_size");
  STRATA_REQUIRE_ERROR(strata_trace_flush(rt.get(), nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "path");
}
