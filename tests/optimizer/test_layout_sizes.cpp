// strata_layout_query against the runtime it describes: for real registrations (every weight
// dtype the optimizer takes, grads in DRAM and in HBM, frozen tensors, AdamW and SGD, both master
// layouts) the query's weights and grads are the DRAM arena's blocks (and the page a layout adds
// to each), its state per element is what the optimizer allocates, its grad fetch buffer is what
// attach lays out, and its state_bytes is exactly the threshold at which the optimizer's PLANNED
// placement stops putting a param's state in DRAM.
#define CATCH_CONFIG_MAIN
#include <memory>
#include <string>
#include <vector>

#include "support/scratch_dir.h"
#include "support/test_support.h"

using namespace strata_test;

namespace {
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kPage = 4096;

struct Layer {
  std::vector<uint64_t> trainable, frozen;
};

struct Query {
  std::vector<strata_layout_layer_t> layers;
  strata_layout_totals_t totals{};
};

strata_layout_request_t request_for(const std::vector<Layer>& layers, strata_dtype_t dtype,
                                    strata_tier_t grad_tier, strata_optimizer_kind_t kind,
                                    int32_t sgd_momentum, uint32_t master_layout,
                                    std::vector<uint32_t>* counts, std::vector<uint64_t>* elements,
                                    std::vector<uint32_t>* frozen_counts,
                                    std::vector<uint64_t>* frozen_elements) {
  strata_layout_request_t q;
  STRATA_REQUIRE_OK(strata_layout_request_init(&q));
  for (const Layer& l : layers) {
    counts->push_back(static_cast<uint32_t>(l.trainable.size()));
    elements->insert(elements->end(), l.trainable.begin(), l.trainable.end());
    frozen_counts->push_back(static_cast<uint32_t>(l.frozen.size()));
    frozen_elements->insert(frozen_elements->end(), l.frozen.begin(), l.frozen.end());
  }
  q.dtype = dtype;
  q.optimizer = kind;
  q.sgd_momentum = sgd_momentum;
  q.master_layout = master_layout;
  q.grad_tier = grad_tier;
  q.layer_count = static_cast<uint32_t>(layers.size());
  q.trainable_counts = counts->data();
  q.trainable_elements = elements->data();
  q.frozen_counts = frozen_counts->data();
  q.frozen_elements = frozen_elements->data();
  return q;
}

Query query(const strata_layout_request_t& q) {
  Query out;
  out.layers.resize(q.layer_count);
  for (auto& l : out.layers) l.struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE;
  out.totals.struct_size = STRATA_LAYOUT_TOTALS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_layout_query(&q, out.layers.data(), &out.totals));
  return out;
}

uint64_t used(strata_runtime_t* rt, strata_tier_t tier) {
  strata_tier_usage_t u{};
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(rt, tier, &u));
  return u.used_bytes;
}

strata_tensor_t* tensor(strata_runtime_t* rt, const std::string& name, uint64_t elements,
                        strata_dtype_t dtype, strata_role_t role, strata_tier_t home) {
  const int64_t shape[1] = {static_cast<int64_t>(elements)};
  const strata_tensor_desc_t d = desc(name.c_str(), shape, 1, home, dtype, role);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(rt, &d, &t));
  return t;
}

struct OptimizerDeleter {
  void operator()(strata_optimizer_t* o) const { (void)strata_optimizer_destroy(o); }
};
using OptimizerPtr = std::unique_ptr<strata_optimizer_t, OptimizerDeleter>;
}  // namespace

TEST_CASE("the layout query is what the arena and the optimizer take", "[layout][optimizer]") {
  struct Case {
    strata_dtype_t dtype;
    strata_tier_t grad_tier;
    strata_optimizer_kind_t kind;
    int32_t momentum;
    uint32_t layout;
  };
  const Case cases[] = {
      {STRATA_DTYPE_BF16, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAMW, 0, STRATA_MASTER_SEPARATE},
      {STRATA_DTYPE_BF16, STRATA_TIER_HBM, STRATA_OPTIMIZER_ADAMW, 0, STRATA_MASTER_SPLIT},
      {STRATA_DTYPE_BF16, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAMW, 0, STRATA_MASTER_SPLIT},
      {STRATA_DTYPE_F16, STRATA_TIER_HBM, STRATA_OPTIMIZER_ADAMW, 0, STRATA_MASTER_SEPARATE},
      {STRATA_DTYPE_F32, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAMW, 0, STRATA_MASTER_SEPARATE},
      {STRATA_DTYPE_F32, STRATA_TIER_HBM, STRATA_OPTIMIZER_SGD, 1, STRATA_MASTER_SEPARATE},
      {STRATA_DTYPE_BF16, STRATA_TIER_DRAM, STRATA_OPTIMIZER_SGD, 0, STRATA_MASTER_SEPARATE},
      // Since 1.4: Adam's two moments, Lion's and Adagrad's one.
      {STRATA_DTYPE_BF16, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAM, 0, STRATA_MASTER_SPLIT},
      {STRATA_DTYPE_F32, STRATA_TIER_DRAM, STRATA_OPTIMIZER_LION, 0, STRATA_MASTER_SEPARATE},
      {STRATA_DTYPE_BF16, STRATA_TIER_HBM, STRATA_OPTIMIZER_ADAGRAD, 0, STRATA_MASTER_SEPARATE},
  };
  // Sizes off every boundary (an odd element count, a tensor below a page, one of several
  // pages), a frozen tensor beside trainable ones, and a layer of frozen tensors only.
  const std::vector<Layer> model = {
      {{1000, 5000, 70001}, {3000}}, {{12345}, {}}, {{}, {777, 40000}}};
  for (const Case& c : cases) {
    CAPTURE(c.dtype, c.grad_tier, c.kind, c.momentum, c.layout);
    std::vector<uint32_t> counts, frozen_counts;
    std::vector<uint64_t> elements, frozen_elements;
    const strata_layout_request_t q =
        request_for(model, c.dtype, c.grad_tier, c.kind, c.momentum, c.layout, &counts, &elements,
                    &frozen_counts, &frozen_elements);
    const Query got = query(q);
    // Since 1.5: the pinned part the query sizes holds what the GPU's copies touch, exactly.
    REQUIRE(got.totals.dram_gpu_bytes == got.totals.weight_bytes + got.totals.grad_dram_bytes +
                                             got.totals.grad_fetch_bytes +
                                             got.totals.dram_margin_bytes);
    strata_runtime_config_t rc = config_for(STRATA_DEVICE_BACKEND_HOST, 64 * kMiB, 64 * kMiB);
    rc.dram_pinned_bytes = got.totals.dram_gpu_bytes;
    RuntimePtr rt = make_runtime(rc);
    uint64_t gpu_blocks = 0, state_blocks = 0;  // what the arena's parts should hold
    strata_optimizer_config_t oc;
    STRATA_REQUIRE_OK(strata_optimizer_config_init(c.kind, &oc));
    if (c.kind == STRATA_OPTIMIZER_SGD) oc.momentum = c.momentum ? 0.9f : 0.f;
    oc.threads = 1;
    strata_optimizer_t* raw = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &oc, &raw));
    OptimizerPtr opt(raw);
    strata_graph_t* graph = nullptr;
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &graph));
    uint64_t weight_total = 0, grad_total = 0, trained = 0;
    for (std::size_t i = 0; i < model.size(); ++i) {
      INFO("layer " << i);
      const Layer& l = model[i];
      const std::string prefix = "layers." + std::to_string(i) + ".";
      std::vector<strata_tensor_t*> weights, grads;
      uint64_t before = used(rt.get(), STRATA_TIER_DRAM);
      for (std::size_t k = 0; k < l.trainable.size() + l.frozen.size(); ++k) {
        const bool frozen = k >= l.trainable.size();
        const uint64_t n = frozen ? l.frozen[k - l.trainable.size()] : l.trainable[k];
        weights.push_back(tensor(rt.get(), prefix + std::to_string(k), n, c.dtype,
                                 STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM));
      }
      const uint64_t tensors = weights.size();
      // The arena's blocks, and the page a layout adds to each tensor.
      REQUIRE(got.layers[i].weight_bytes ==
              used(rt.get(), STRATA_TIER_DRAM) - before + tensors * kPage);
      gpu_blocks += used(rt.get(), STRATA_TIER_DRAM) - before;
      weight_total += got.layers[i].weight_bytes;
      before = used(rt.get(), STRATA_TIER_DRAM);
      const uint64_t hbm_before = used(rt.get(), STRATA_TIER_HBM);
      uint64_t grad_bytes = 0;
      for (std::size_t k = 0; k < l.trainable.size(); ++k) {
        grads.push_back(tensor(rt.get(), prefix + std::to_string(k) + ".grad", l.trainable[k],
                               c.dtype, STRATA_ROLE_GRAD, c.grad_tier));
        grad_bytes += l.trainable[k] * strata_dtype_size(c.dtype);
      }
      gpu_blocks += used(rt.get(), STRATA_TIER_DRAM) - before;
      if (c.grad_tier == STRATA_TIER_DRAM) {
        REQUIRE(got.layers[i].grad_bytes ==
                used(rt.get(), STRATA_TIER_DRAM) - before + grads.size() * kPage);
        REQUIRE(got.layers[i].grad_hbm_bytes == 0);
      } else {
        REQUIRE(used(rt.get(), STRATA_TIER_DRAM) == before);
        // The HBM arena's 256-byte blocks, within the 1% and 64 KiB a layout counts.
        REQUIRE(got.layers[i].grad_hbm_bytes >= used(rt.get(), STRATA_TIER_HBM) - hbm_before);
        REQUIRE(got.layers[i].grad_hbm_bytes == grad_bytes + grad_bytes / 100 + 64 * 1024);
      }
      uint64_t planned = 0;
      for (std::size_t k = 0; k < l.trainable.size(); ++k) {
        strata_param_desc_t p{};
        p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
        p.weight = weights[k];
        p.grad = grads[k];
        p.master_layout = c.layout;
        const uint64_t state_before = used(rt.get(), STRATA_TIER_DRAM);
        STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
        // One param's state as the query counts it (a layer of that tensor alone): never less
        // than what the optimizer took of the arena.
        const uint32_t one_count = 1;
        const uint64_t one = l.trainable[k];
        strata_layout_request_t single = q;
        single.layer_count = 1;
        single.trainable_counts = &one_count;
        single.trainable_elements = &one;
        single.frozen_counts = nullptr;
        const uint64_t counted = query(single).layers[0].state_bytes;
        const uint64_t took = used(rt.get(), STRATA_TIER_DRAM) - state_before;
        REQUIRE(took <= counted);
        state_blocks += took;
        REQUIRE((took == 0) == (got.totals.state_bytes_per_element == 0));
        planned += counted;
        trained += l.trainable[k];
      }
      REQUIRE(got.layers[i].state_bytes == planned);
      strata_layer_desc_t d{};
      d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
      d.weights = weights.data();
      d.weight_count = static_cast<uint32_t>(weights.size());
      d.grads = grads.data();
      d.grad_count = static_cast<uint32_t>(grads.size());
      STRATA_REQUIRE_OK(strata_graph_add_layer(graph, &d, nullptr));
      grad_total += got.layers[i].grad_bytes;
    }
    REQUIRE(got.totals.weight_bytes == weight_total);
    strata_optimizer_stats_t stats{};
    stats.struct_size = STRATA_OPTIMIZER_STATS_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_optimizer_get_stats(opt.get(), &stats));
    // The optimizer's state is the query's bytes per element, exactly.
    REQUIRE(stats.state_bytes == trained * got.totals.state_bytes_per_element);
    REQUIRE(got.totals.update_elements == trained);
    // The grad fetch buffer attach lays out: one arena block, and the page a layout adds.
    strata_plan_t* plan = nullptr;
    STRATA_REQUIRE_OK(strata_plan_create(graph, nullptr, &plan));
    strata_executor_t* ex = nullptr;
    STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
    const uint64_t before_attach = used(rt.get(), STRATA_TIER_DRAM);
    STRATA_REQUIRE_OK(strata_optimizer_attach(opt.get(), ex));
    const uint64_t fetch = used(rt.get(), STRATA_TIER_DRAM) - before_attach;
    // Weights, grads and the fetch buffer in the pinned part, the state in the other, none
    // displaced: the query's size is enough.
    strata_tier_usage_t parts{};
    parts.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_runtime_tier_usage(rt.get(), STRATA_TIER_DRAM, &parts));
    REQUIRE(parts.pinned_budget_bytes == got.totals.dram_gpu_bytes);
    REQUIRE(parts.pinned_used_bytes == gpu_blocks + fetch);
    REQUIRE(parts.used_bytes - parts.pinned_used_bytes == state_blocks);
    REQUIRE(parts.dram_fallbacks == 0);
    if (c.grad_tier == STRATA_TIER_HBM) {
      REQUIRE(fetch > 0);
      REQUIRE(got.totals.grad_fetch_bytes == fetch + kPage);
      REQUIRE(got.totals.grad_dram_bytes == 0);
    } else {
      REQUIRE(fetch == 0);
      REQUIRE(got.totals.grad_fetch_bytes == 0);
      REQUIRE(got.totals.grad_dram_bytes == grad_total);
    }
    opt.reset();
    REQUIRE(strata_executor_destroy(ex) == STRATA_OK);
    REQUIRE(strata_plan_destroy(plan) == STRATA_OK);
    REQUIRE(strata_graph_destroy(graph) == STRATA_OK);
  }
}

TEST_CASE("PLANNED keeps a param's state in DRAM exactly while the query's state_bytes fits",
          "[layout][optimizer][nvme]") {
  ScratchDir scratch;
  const std::string file = scratch.file("tier");
  const char* paths[1] = {file.c_str()};
  for (const strata_dtype_t dtype : {STRATA_DTYPE_BF16, STRATA_DTYPE_F32}) {
    CAPTURE(dtype);
    strata_runtime_config_t config = config_for(STRATA_DEVICE_BACKEND_HOST, 16 * kMiB, 64 * kMiB);
    config.nvme_paths = paths;
    config.nvme_path_count = 1;
    config.nvme_budget_bytes = 64 * kMiB;
    RuntimePtr rt = make_runtime(config);
    const uint64_t n = 300001;
    strata_tensor_t* w = tensor(rt.get(), "w", n, dtype, STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
    strata_tensor_t* g = tensor(rt.get(), "w.grad", n, dtype, STRATA_ROLE_GRAD, STRATA_TIER_DRAM);
    std::vector<uint32_t> counts, frozen_counts;
    std::vector<uint64_t> elements, frozen_elements;
    const strata_layout_request_t q =
        request_for({{{n}, {}}}, dtype, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAMW, 0,
                    STRATA_MASTER_SEPARATE, &counts, &elements, &frozen_counts, &frozen_elements);
    const uint64_t need = query(q).layers[0].state_bytes;
    const uint64_t free = 64 * kMiB - used(rt.get(), STRATA_TIER_DRAM);
    REQUIRE(free > need);
    // DRAM keeps nvme_staging_bytes free after the state: the state stays while free - need
    // covers it, and goes to NVMe one byte past that.
    for (const uint64_t keep : {free - need, free - need + 1}) {
      strata_optimizer_config_t oc;
      STRATA_REQUIRE_OK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &oc));
      oc.threads = 1;
      oc.state_placement = STRATA_STATE_PLACEMENT_PLANNED;
      oc.nvme_staging_bytes = keep;
      strata_optimizer_t* raw = nullptr;
      STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &oc, &raw));
      OptimizerPtr opt(raw);
      strata_param_desc_t p{};
      p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
      p.weight = w;
      p.grad = g;
      STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
      strata_tensor_t* m = nullptr;
      STRATA_REQUIRE_OK(strata_optimizer_get_state(opt.get(), w, STRATA_STATE_EXP_AVG, &m));
      strata_tier_t tier = -1;
      STRATA_REQUIRE_OK(strata_tensor_tier(rt.get(), m, &tier));
      REQUIRE(tier == (keep == free - need ? STRATA_TIER_DRAM : STRATA_TIER_NVME));
    }
  }
}

TEST_CASE("the layout query's accum_bytes holds what the accumulators take",
          "[layout][optimizer]") {
  // Trainable tensors off every page boundary; a frozen one (no accumulator).
  const std::vector<Layer> model = {{{1000, 5000, 70001}, {3000}}, {{12345}, {}}};
  std::vector<uint32_t> counts, frozen_counts;
  std::vector<uint64_t> elements, frozen_elements;
  const strata_layout_request_t q =
      request_for(model, STRATA_DTYPE_BF16, STRATA_TIER_DRAM, STRATA_OPTIMIZER_ADAMW, 0,
                  STRATA_MASTER_SEPARATE, &counts, &elements, &frozen_counts, &frozen_elements);
  const Query got = query(q);
  uint64_t expected = 0, trained = 0;
  for (const Layer& l : model) {
    for (uint64_t n : l.trainable) {
      expected += (4 * n + kPage - 1) / kPage * kPage + kPage;  // its pages and one more
      trained += n;
    }
  }
  REQUIRE(got.totals.accum_bytes == expected);
  // AUTO mode with accumulation_steps 2 allocates the same accumulators at add_param: the
  // DRAM they take beside the rest of the state is within the query's figure.
  uint64_t state_used[2] = {0, 0};
  for (uint32_t steps : {1u, 2u}) {
    RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 64 * kMiB, 64 * kMiB));
    strata_optimizer_config_t oc;
    STRATA_REQUIRE_OK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &oc));
    oc.threads = 1;
    oc.accumulation_steps = steps;
    strata_optimizer_t* raw = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &oc, &raw));
    OptimizerPtr opt(raw);
    for (std::size_t i = 0; i < model.size(); ++i) {
      for (std::size_t k = 0; k < model[i].trainable.size(); ++k) {
        const std::string name = "layers." + std::to_string(i) + "." + std::to_string(k);
        const uint64_t n = model[i].trainable[k];
        strata_param_desc_t p{};
        p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
        p.weight =
            tensor(rt.get(), name, n, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM);
        p.grad = tensor(rt.get(), name + ".grad", n, STRATA_DTYPE_BF16, STRATA_ROLE_GRAD,
                        STRATA_TIER_DRAM);
        const uint64_t before = used(rt.get(), STRATA_TIER_DRAM);
        STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
        state_used[steps - 1] += used(rt.get(), STRATA_TIER_DRAM) - before;
      }
    }
  }
  const uint64_t accumulators = state_used[1] - state_used[0];
  REQUIRE(accumulators >= 4 * trained);
  REQUIRE(accumulators <= got.totals.accum_bytes);
}

TEST_CASE("in-place sums: the query counts f32 grads in HBM and no accumulators, as allocated",
          "[layout][optimizer][grad_sum]") {
  const std::vector<Layer> model = {{{1000, 5000, 70001}, {3000}}, {{12345}, {}}};
  std::vector<uint32_t> counts, frozen_counts;
  std::vector<uint64_t> elements, frozen_elements;
  strata_layout_request_t q =
      request_for(model, STRATA_DTYPE_BF16, STRATA_TIER_HBM, STRATA_OPTIMIZER_ADAMW, 0,
                  STRATA_MASTER_SEPARATE, &counts, &elements, &frozen_counts, &frozen_elements);
  REQUIRE(q.grad_sum == STRATA_GRAD_SUM_ACCUMULATOR);  // the default
  const Query accumulated = query(q);
  q.grad_sum = STRATA_GRAD_SUM_IN_PLACE;
  const Query got = query(q);
  REQUIRE(accumulated.totals.accum_bytes > 0);
  REQUIRE(got.totals.accum_bytes == 0);
  for (std::size_t i = 0; i < model.size(); ++i) {
    uint64_t n = 0;
    for (uint64_t e : model[i].trainable) n += e;
    // fp32 grads: 4 bytes an element, with the HBM arena's 1% and 64 KiB.
    REQUIRE(got.layers[i].grad_hbm_bytes == 4 * n + 4 * n / 100 + 64 * 1024);
    REQUIRE(got.layers[i].grad_bytes > accumulated.layers[i].grad_bytes);
  }
  REQUIRE(got.totals.grad_hbm_bytes == got.layers[0].grad_hbm_bytes + got.layers[1].grad_hbm_bytes);
  REQUIRE(got.totals.grad_fetch_bytes > accumulated.totals.grad_fetch_bytes);
  REQUIRE(got.totals.grad_fetch_bytes >= 4 * (1000 + 5000 + 70001));
  REQUIRE(got.totals.streaming_hbm_bytes - accumulated.totals.streaming_hbm_bytes ==
          got.totals.grad_hbm_bytes - accumulated.totals.grad_hbm_bytes);
  REQUIRE(got.totals.nvme_bytes < accumulated.totals.nvme_bytes);  // no accumulators to spill

  // What an explicit optimizer with in-place params takes: the f32 grads' HBM within the
  // query's figure, the fetch buffer its figure exactly, and no accumulator after accumulating.
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 64 * kMiB, 64 * kMiB));
  strata_optimizer_config_t oc;
  STRATA_REQUIRE_OK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &oc));
  oc.threads = 1;
  oc.update_mode = STRATA_UPDATE_EXPLICIT;
  strata_optimizer_t* raw = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &oc, &raw));
  OptimizerPtr opt(raw);
  strata_graph_t* graph = nullptr;
  STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &graph));
  for (std::size_t i = 0; i < model.size(); ++i) {
    std::vector<strata_tensor_t*> weights, grads;
    const uint64_t hbm_before = used(rt.get(), STRATA_TIER_HBM);
    for (std::size_t k = 0; k < model[i].trainable.size(); ++k) {
      const std::string name = "layers." + std::to_string(i) + "." + std::to_string(k);
      const uint64_t n = model[i].trainable[k];
      weights.push_back(
          tensor(rt.get(), name, n, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT, STRATA_TIER_DRAM));
      grads.push_back(
          tensor(rt.get(), name + ".grad", n, STRATA_DTYPE_F32, STRATA_ROLE_GRAD, STRATA_TIER_HBM));
      strata_param_desc_t p{};
      p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
      p.weight = weights.back();
      p.grad = grads.back();
      p.grad_sum = STRATA_GRAD_SUM_IN_PLACE;
      STRATA_REQUIRE_OK(strata_optimizer_add_param(opt.get(), &p));
    }
    REQUIRE(used(rt.get(), STRATA_TIER_HBM) - hbm_before <= got.layers[i].grad_hbm_bytes);
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = weights.data();
    d.weight_count = static_cast<uint32_t>(weights.size());
    d.grads = grads.data();
    d.grad_count = static_cast<uint32_t>(grads.size());
    STRATA_REQUIRE_OK(strata_graph_add_layer(graph, &d, nullptr));
  }
  strata_plan_t* plan = nullptr;
  STRATA_REQUIRE_OK(strata_plan_create(graph, nullptr, &plan));
  strata_executor_t* ex = nullptr;
  STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
  const uint64_t before_attach = used(rt.get(), STRATA_TIER_DRAM);
  STRATA_REQUIRE_OK(strata_optimizer_attach(opt.get(), ex));
  REQUIRE(got.totals.grad_fetch_bytes == used(rt.get(), STRATA_TIER_DRAM) - before_attach + kPage);
  // Two backward passes onto grads never zeroed: an accumulation, with nothing placed for it.
  const uint64_t before_steps = used(rt.get(), STRATA_TIER_DRAM);
  for (int pass = 0; pass < 2; ++pass) {
    STRATA_REQUIRE_OK(strata_step_begin(ex));
    strata_layer_views_t v{};
    v.struct_size = STRATA_LAYER_VIEWS_STRUCT_SIZE;
    for (uint32_t l = 0; l < model.size(); ++l) {
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_FORWARD, nullptr, 0, &v));
      STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_FORWARD, nullptr));
    }
    for (uint32_t l = static_cast<uint32_t>(model.size()); l-- > 0;) {
      STRATA_REQUIRE_OK(strata_layer_acquire(ex, l, STRATA_PHASE_BACKWARD, nullptr, 0, &v));
      STRATA_REQUIRE_OK(strata_layer_release(ex, l, STRATA_PHASE_BACKWARD, nullptr));
    }
    STRATA_REQUIRE_OK(strata_step_end(ex));
  }
  REQUIRE(used(rt.get(), STRATA_TIER_DRAM) == before_steps);
  // And nothing was copied out of HBM: a landing marks a sum unmeasured instead of fetching it.
  strata_link_stats_t d2h{};
  d2h.struct_size = STRATA_LINK_STATS_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_link_stats(rt.get(), STRATA_LINK_D2H, &d2h));
  REQUIRE(d2h.bytes == 0);
  opt.reset();
  REQUIRE(strata_executor_destroy(ex) == STRATA_OK);
  REQUIRE(strata_plan_destroy(plan) == STRATA_OK);
  REQUIRE(strata_graph_destroy(graph) == STRATA_OK);

  // Refused: in-place sums of grads in DRAM, an unknown grad_sum; nothing written.
  strata_layout_totals_t totals{};
  totals.struct_size = STRATA_LAYOUT_TOTALS_STRUCT_SIZE;
  q.grad_tier = STRATA_TIER_DRAM;
  STRATA_REQUIRE_ERROR(strata_layout_query(&q, nullptr, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "need grad_tier STRATA_TIER_HBM");
  q.grad_tier = STRATA_TIER_HBM;
  q.grad_sum = 5;
  STRATA_REQUIRE_ERROR(strata_layout_query(&q, nullptr, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "unknown grad_sum 5");
  REQUIRE(totals.accum_bytes == 0);
  REQUIRE(totals.grad_hbm_bytes == 0);
  // A 1.4 caller's request ends before grad_sum: accumulators, whatever lies beyond.
  q.grad_sum = STRATA_GRAD_SUM_IN_PLACE;
  q.struct_size = offsetof(strata_layout_request_t, grad_sum);
  STRATA_REQUIRE_OK(strata_layout_query(&q, nullptr, &totals));
  REQUIRE(totals.accum_bytes == accumulated.totals.accum_bytes);
  REQUIRE(totals.grad_hbm_bytes == accumulated.totals.grad_hbm_bytes);
}
