// libFuzzer: graph and plan API sequences through the C ABI. The input is a little program:
// tensors of fuzzed sizes, homes and roles; layers drawn from them (repeats, foreign handles,
// empty lists); residents; plan configs with fuzzed numbers (NaN, inf, huge); a few executor
// steps with acquires and releases in fuzzed order; then a placement request with fuzzed
// sizes, tiers, budgets and rates (NaN, inf, huge, all given: no measurement per input); then a
// step profile with fuzzed blocks, intervals, flags and figures (huge, invalid enums and bits).
// Every call must return a status.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "strata/strata.h"

namespace {

struct Input {
  const uint8_t* p;
  size_t n;
  template <typename T>
  T get() {
    T v{};
    const size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
  bool empty() const { return n == 0; }
};

strata_runtime_t* runtime() {
  static strata_runtime_t* rt = [] {
    strata_runtime_config_t c;
    strata_runtime_config_init(&c);
    c.device_backend = STRATA_DEVICE_BACKEND_HOST;
    c.hbm_budget_bytes = 8u << 20;
    c.dram_budget_bytes = 16u << 20;
    strata_runtime_t* r = nullptr;
    strata_runtime_create(&c, &r);
    return r;
  }();
  return rt;
}

// A placement request from the rest of the input. Sizes mix small and huge (up to 2^64 - 1),
// tiers include invalid values, rates may be NaN, inf or 0 (not counted without a runtime).
void fuzz_placement(Input& in) {
  const unsigned count = in.get<uint8_t>() % 80;
  std::vector<strata_placement_layer_t> layers(count);
  std::vector<const strata_placement_layer_t*> pointers;
  auto size = [&] {
    const uint8_t shift = in.get<uint8_t>() % 72;
    return shift >= 64 ? UINT64_MAX : static_cast<uint64_t>(in.get<uint16_t>()) << (shift % 48);
  };
  for (auto& l : layers) {
    strata_placement_layer_init(&l);
    if (in.get<uint8_t>() % 16 == 0) l.struct_size = in.get<uint8_t>();
    l.weight_bytes = size();
    l.grad_bytes = size();
    l.state_bytes = size();
    l.update_elements = size();
    l.forward_seconds = in.get<double>();
    l.backward_seconds = in.get<double>();
    l.weight_tier = static_cast<int8_t>(in.get<uint8_t>()) % 4;
    l.state_tier = static_cast<int8_t>(in.get<uint8_t>()) % 4;
    l.grad_tier = static_cast<int8_t>(in.get<uint8_t>()) % 3;
    pointers.push_back(in.get<uint8_t>() == 255 ? nullptr : &l);
  }
  strata_placement_request_t q;
  strata_placement_request_init(&q);
  q.layers = pointers.data();
  q.layer_count = static_cast<uint32_t>(pointers.size());
  q.staging_slots = in.get<uint8_t>() % 8;
  q.max_staging_slots = in.get<uint8_t>() % 2 ? in.get<uint8_t>() % 8 : in.get<uint32_t>();
  q.prefetch_depth = in.get<uint8_t>() % 2 ? in.get<uint8_t>() : in.get<uint32_t>();
  q.dram_budget_bytes = size();
  q.nvme_budget_bytes = size();
  q.other_device_seconds = in.get<double>();
  q.h2d_bytes_per_second = in.get<double>();
  q.d2h_bytes_per_second = in.get<double>();
  q.nvme_read_bytes_per_second = in.get<double>();
  q.nvme_write_bytes_per_second = in.get<double>();
  q.nvme_mixed = in.get<double>();
  q.update_elements_per_second = in.get<double>();
  q.updates_after_backward = in.get<uint8_t>() % 2;
  strata_placement_t* p = nullptr;
  if (strata_placement_create(nullptr, &q, &p) == STRATA_OK) {
    strata_placement_info_t info{};
    info.struct_size = STRATA_PLACEMENT_INFO_STRUCT_SIZE;
    (void)strata_placement_get_info(p, &info);
    int32_t w = 0, st = 0;
    (void)strata_placement_get_layer(p, in.get<uint8_t>(), &w, &st);
    char buf[512];
    size_t needed = 0;
    (void)strata_placement_dump(p, in.get<uint8_t>() % 3, buf, sizeof buf, &needed);
    (void)strata_placement_destroy(p);
  }
}

}  // namespace

// A step profile from the rest of the input: every field drawn, sizes small or huge (up to
// 2^64 - 1), enums and flags including invalid values. A plan, when made, is read back whole.
void fuzz_step_plan(Input& in) {
  auto size = [&] {
    const uint8_t shift = in.get<uint8_t>() % 72;
    return shift >= 64 ? UINT64_MAX : static_cast<uint64_t>(in.get<uint16_t>()) << (shift % 48);
  };
  const unsigned count = in.get<uint8_t>() % 40;
  std::vector<strata_step_block_t> blocks(count);
  std::vector<const strata_step_block_t*> block_ptrs;
  for (auto& b : blocks) {
    strata_step_block_init(&b);
    if (in.get<uint8_t>() % 16 == 0) b.struct_size = in.get<uint8_t>();
    b.elements = size();
    b.rank_elements = in.get<uint8_t>() % 4 == 0 ? size() : 0;
    b.keep_whole_bytes = size();
    b.keep_selective_bytes = size();
    b.residency = in.get<int8_t>() % 4;
    b.keep = in.get<int8_t>() % 4;
    block_ptrs.push_back(in.get<uint8_t>() % 64 == 0 ? nullptr : &b);
  }
  const unsigned points = in.get<uint8_t>() % 90;
  std::vector<strata_step_interval_t> intervals(points);
  std::vector<const strata_step_interval_t*> interval_ptrs;
  for (auto& t : intervals) {
    strata_step_interval_init(&t);
    t.point = in.get<int8_t>() % 4;
    t.block = in.get<uint8_t>() % 48;
    t.allocated_peak_bytes = size();
    t.reserved_peak_bytes = size();
    interval_ptrs.push_back(&t);
  }
  strata_step_profile_t q;
  strata_step_profile_init(&q);
  q.blocks = block_ptrs.data();
  q.block_count = count;
  q.intervals = interval_ptrs.data();
  q.interval_count = points;
  q.flags = in.get<uint8_t>() % 8 == 0 ? in.get<uint32_t>() : in.get<uint16_t>() & 0x703u;
  q.ranks_on_host = in.get<uint8_t>();
  q.resident_bytes_per_param = in.get<uint8_t>();
  q.streamed_grad_bytes_per_param = in.get<uint8_t>() % 12;
  for (uint64_t* field : {&q.device_total_bytes,
                          &q.device_free_bytes,
                          &q.framework_held_bytes,
                          &q.hbm_tier_bytes,
                          &q.outside_elements,
                          &q.streamed_grads_hbm_bytes,
                          &q.tokens,
                          &q.checkpoint_bytes,
                          &q.block_saved_bytes,
                          &q.in_use_bytes,
                          &q.backward_grad_bytes,
                          &q.leaving_bytes,
                          &q.vocab,
                          &q.hidden,
                          &q.loss_chunk_tokens,
                          &q.loss_working_bytes,
                          &q.step_allocated_peak_bytes,
                          &q.step_reserved_peak_bytes,
                          &q.host_budget_bytes,
                          &q.arena_bytes,
                          &q.host_available_bytes,
                          &q.beside_bytes}) {
    *field = in.get<uint8_t>() % 3 == 0 ? 0 : size();
  }
  // Sequence tiles: the MLP's bytes a token (often small enough to be a part of the block's),
  // and now and then a count given.
  q.mlp_token_bytes = in.get<uint8_t>() % 2 == 0 ? 0 : size() % 4096;
  q.mlp_tiles = in.get<uint8_t>() % 4 == 0 ? in.get<uint32_t>() % 64 : 0;
  strata_step_plan_t* plan = nullptr;
  if (strata_step_plan_create(&q, &plan) != STRATA_OK) return;
  strata_step_plan_info_t info{};
  info.struct_size = STRATA_STEP_PLAN_INFO_STRUCT_SIZE;
  strata_step_plan_get_info(plan, &info);
  for (uint32_t i = 0; i <= info.blocks; ++i) {  // one past the end: refused
    strata_step_block_t b{};
    b.struct_size = STRATA_STEP_BLOCK_STRUCT_SIZE;
    strata_step_plan_get_block(plan, i, &b);
  }
  for (strata_plan_format_t format : {STRATA_PLAN_FORMAT_JSON, STRATA_PLAN_FORMAT_TEXT}) {
    size_t length = 0;
    if (strata_step_plan_dump(plan, format, nullptr, 0, &length) == STRATA_OK) {
      std::string text(length + 1, '\0');
      strata_step_plan_dump(plan, format, text.data(), text.size(), nullptr);
    }
  }
  strata_step_plan_destroy(plan);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  strata_runtime_t* rt = runtime();
  if (rt == nullptr) return 0;
  Input in{data, size};
  std::vector<strata_tensor_t*> tensors;
  const unsigned count = in.get<uint8_t>() % 12;
  for (unsigned i = 0; i < count; ++i) {
    const int64_t shape[1] = {static_cast<int64_t>(in.get<uint16_t>()) *
                              (1 + in.get<uint8_t>() % 16)};
    strata_tensor_desc_t d{};
    d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
    const std::string name = "t" + std::to_string(i);
    d.name = name.c_str();
    d.dtype = in.get<uint8_t>() % 11;
    d.ndim = 1;
    d.shape = shape;
    d.role = in.get<uint8_t>() % 5;
    d.home_tier = in.get<uint8_t>() % 4;
    strata_tensor_t* t = nullptr;
    if (strata_tensor_register(rt, &d, &t) == STRATA_OK) tensors.push_back(t);
  }
  auto pick = [&](std::vector<strata_tensor_t*>* out) {
    const unsigned k = in.get<uint8_t>() % 4;
    for (unsigned j = 0; j < k; ++j) {
      const uint8_t which = in.get<uint8_t>();
      if (which == 255) {
        out->push_back(reinterpret_cast<strata_tensor_t*>(uintptr_t{0xdead}));  // foreign
      } else if (!tensors.empty()) {
        out->push_back(tensors[which % tensors.size()]);
      }
    }
  };
  strata_graph_t* graph = nullptr;
  if (strata_graph_create(rt, &graph) == STRATA_OK) {
    const unsigned layers = in.get<uint8_t>() % 6;
    for (unsigned l = 0; l < layers && !in.empty(); ++l) {
      std::vector<strata_tensor_t*> w, g, a;
      pick(&w);
      pick(&g);
      pick(&a);
      strata_layer_desc_t d{};
      d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
      d.weights = w.data();
      d.weight_count = static_cast<uint32_t>(w.size());
      d.grads = g.data();
      d.grad_count = static_cast<uint32_t>(g.size());
      d.activations = a.data();
      d.activation_count = static_cast<uint32_t>(a.size());
      uint32_t index = 0;
      (void)strata_graph_add_layer(graph, &d, &index);
      if (in.get<uint8_t>() % 4 == 0 && !tensors.empty()) {
        (void)strata_graph_add_resident(graph, tensors[in.get<uint8_t>() % tensors.size()]);
      }
    }
    strata_plan_config_t pc;
    strata_plan_config_init(&pc);
    pc.micro_batches = in.get<uint8_t>() % 4;
    pc.hbm_slot_budget_bytes = in.get<uint32_t>();
    // Never 0: measuring the links costs 64 MiB copies per input.
    const double h2d = in.get<double>(), d2h = in.get<double>();
    pc.h2d_bytes_per_second = h2d == 0 ? 1e9 : h2d;
    pc.d2h_bytes_per_second = d2h == 0 ? 1e9 : d2h;
    pc.device_flops_per_second = in.get<double>();
    pc.max_prefetch_depth = in.get<uint8_t>();
    pc.chunk_bytes = in.get<uint32_t>();
    strata_plan_t* plan = nullptr;
    if (strata_plan_create(graph, &pc, &plan) == STRATA_OK) {
      char buf[256];
      size_t needed = 0;
      (void)strata_plan_dump(plan, in.get<uint8_t>() % 3, buf, sizeof buf, &needed);
      strata_executor_t* ex = nullptr;
      if (strata_executor_create(plan, &ex) == STRATA_OK) {
        const unsigned ops = in.get<uint8_t>() % 24;
        for (unsigned k = 0; k < ops && !in.empty(); ++k) {
          const uint8_t op = in.get<uint8_t>();
          const uint32_t layer = in.get<uint8_t>() % 8;
          const strata_phase_t phase = in.get<uint8_t>() % 3;
          strata_layer_views_t v{};
          v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
          switch (op % 4) {
            case 0:
              (void)strata_step_begin(ex);
              break;
            case 1:
              (void)strata_layer_acquire(ex, layer, phase, nullptr, op >> 4, &v);
              break;
            case 2:
              (void)strata_layer_release(ex, layer, phase, nullptr);
              break;
            default:
              (void)strata_step_end(ex);
              break;
          }
        }
        (void)strata_executor_destroy(ex);
      }
      (void)strata_plan_destroy(plan);
    }
    (void)strata_graph_destroy(graph);
  }
  for (strata_tensor_t* t : tensors) (void)strata_tensor_unregister(rt, t);
  fuzz_placement(in);
  fuzz_step_plan(in);
  return 0;
}
