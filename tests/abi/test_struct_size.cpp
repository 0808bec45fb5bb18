// The struct_size rule for every argument struct of strata.h (issue 50, item 5): a size is
// accepted iff it is one a released header's STRATA_*_STRUCT_SIZE gave the struct, or at least
// this header's (a newer caller). Any other size (0, below the first release, between releases,
// ending inside a field) is INVALID_ARGUMENT, and then an output struct is left untouched. The
// released sizes are written here as numbers, found in the headers of releases 1.0 .. 1.5
// (git history; the host buffer structs are 1.5's), not taken from the library's table: the test
// checks that table from outside.
#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.h"

using namespace strata_test;

static_assert(sizeof(void*) == 8 && sizeof(size_t) == 8, "the released sizes below are LP64's");

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr unsigned char kSentinel = 0xA5;

struct Row {
  const char* type;
  const char* macro;
  std::size_t current;                // the macro's value
  std::vector<std::size_t> released;  // every release's size, oldest first
};

#define ROW(type, macro, ...) \
  Row {                       \
#type, #macro, macro, {   \
      __VA_ARGS__             \
    }                         \
  }
// 1.0 .. 1.4 then 1.5 where a struct grew; optimizer_stats' 136 is 1.1's sizeof, what the 1.1
// Python package passes (it ends in padding before 1.2's first field).
const Row kRows[] = {
    ROW(strata_runtime_config_t, STRATA_RUNTIME_CONFIG_STRUCT_SIZE, 96, 104),
    ROW(strata_capabilities_t, STRATA_CAPABILITIES_STRUCT_SIZE, 816, 824),
    ROW(strata_tier_usage_t, STRATA_TIER_USAGE_STRUCT_SIZE, 40, 64),
    ROW(strata_link_stats_t, STRATA_LINK_STATS_STRUCT_SIZE, 32),
    ROW(strata_tensor_desc_t, STRATA_TENSOR_DESC_STRUCT_SIZE, 40),
    ROW(strata_tensor_info_t, STRATA_TENSOR_INFO_STRUCT_SIZE, 364),
    ROW(strata_layer_desc_t, STRATA_LAYER_DESC_STRUCT_SIZE, 96),
    ROW(strata_plan_config_t, STRATA_PLAN_CONFIG_STRUCT_SIZE, 64),
    ROW(strata_plan_info_t, STRATA_PLAN_INFO_STRUCT_SIZE, 128),
    ROW(strata_layer_views_t, STRATA_LAYER_VIEWS_STRUCT_SIZE, 56),
    ROW(strata_executor_stats_t, STRATA_EXECUTOR_STATS_STRUCT_SIZE, 48),
    ROW(strata_optimizer_config_t, STRATA_OPTIMIZER_CONFIG_STRUCT_SIZE, 76, 80, 96),
    ROW(strata_param_desc_t, STRATA_PARAM_DESC_STRUCT_SIZE, 28, 32, 36),
    ROW(strata_group_hyperparams_t, STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE, 28),
    ROW(strata_grad_info_t, STRATA_GRAD_INFO_STRUCT_SIZE, 32),
    ROW(strata_optimizer_stats_t, STRATA_OPTIMIZER_STATS_STRUCT_SIZE, 132, 136, 200),
    ROW(strata_trace_config_t, STRATA_TRACE_CONFIG_STRUCT_SIZE, 12),
    ROW(strata_trace_counters_t, STRATA_TRACE_COUNTERS_STRUCT_SIZE, 144),
    ROW(strata_placement_layer_t, STRATA_PLACEMENT_LAYER_STRUCT_SIZE, 76),
    ROW(strata_placement_request_t, STRATA_PLACEMENT_REQUEST_STRUCT_SIZE, 108),
    ROW(strata_placement_info_t, STRATA_PLACEMENT_INFO_STRUCT_SIZE, 200),
    ROW(strata_layout_request_t, STRATA_LAYOUT_REQUEST_STRUCT_SIZE, 80, 84),
    ROW(strata_layout_layer_t, STRATA_LAYOUT_LAYER_STRUCT_SIZE, 48),
    ROW(strata_layout_totals_t, STRATA_LAYOUT_TOTALS_STRUCT_SIZE, 128, 136, 144),
    ROW(strata_step_profile_t, STRATA_STEP_PROFILE_STRUCT_SIZE, 292),
    ROW(strata_step_block_t, STRATA_STEP_BLOCK_STRUCT_SIZE, 76),
    ROW(strata_step_interval_t, STRATA_STEP_INTERVAL_STRUCT_SIZE, 32),
    ROW(strata_step_plan_info_t, STRATA_STEP_PLAN_INFO_STRUCT_SIZE, 140),
    ROW(strata_host_usage_t, STRATA_HOST_USAGE_STRUCT_SIZE, 64),
    ROW(strata_host_buffer_desc_t, STRATA_HOST_BUFFER_DESC_STRUCT_SIZE, 24),
    ROW(strata_host_buffer_info_t, STRATA_HOST_BUFFER_INFO_STRUCT_SIZE, 40),
};
#undef ROW

const Row& row(const std::string& type) {
  for (const Row& r : kRows) {
    if (type == r.type) return r;
  }
  FAIL("no row for " << type);
  throw std::logic_error("unreachable");
}

std::vector<std::size_t> accepted_sizes(const Row& r) {
  std::vector<std::size_t> sizes = r.released;
  sizes.push_back(r.current + 8);  // a newer header's, with a field this library does not know
  return sizes;
}

// 0, struct_size alone, one byte short of every release (inside its last field), one byte past
// each older release (inside the next release's first field, or its padding), and a size
// ending in the middle of the last field.
std::vector<std::size_t> refused_sizes(const Row& r) {
  std::set<std::size_t> sizes{0, sizeof(size_t), r.current - 2};
  for (const std::size_t s : r.released) {
    sizes.insert(s - 1);
    if (s < r.current) sizes.insert(s + 1);
  }
  for (const std::size_t s : r.released) sizes.erase(s);
  return {sizes.begin(), sizes.end()};
}

// Aligned bytes for a caller's struct of `size` bytes and beyond, filled with the sentinel: what
// lies past struct_size must be neither read (input) nor written (output).
class Buffer {
 public:
  explicit Buffer(std::size_t size) : words_(size / sizeof(std::max_align_t) + 4) {
    std::memset(data(), kSentinel, bytes());
  }
  unsigned char* data() { return reinterpret_cast<unsigned char*>(words_.data()); }
  std::size_t bytes() const { return words_.size() * sizeof(std::max_align_t); }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data());
  }

 private:
  std::vector<std::max_align_t> words_;
};

std::string refusal(const Row& r, std::size_t size) {
  return std::string(r.type) + ".struct_size is " + std::to_string(size) + ",";
}

// The structs the checks below went through: the last check is that it is every row.
std::set<std::string>& exercised() {
  static std::set<std::string> types;
  return types;
}

// An input struct: `make` gives a valid one (all of this header's fields), `call` passes it to
// the library and undoes what it made. At an older release's size the bytes past it are the
// sentinel, which as a field would be refused or fail the call: they must not be read.
template <typename T>
void check_input(const char* type, const std::function<T()>& make,
                 const std::function<strata_status_t(T*)>& call) {
  const Row& r = row(type);
  exercised().insert(type);
  REQUIRE(r.current == r.released.back());
  for (const std::size_t size : accepted_sizes(r)) {
    INFO(r.type << " struct_size " << size);
    Buffer b(std::max(size, sizeof(T)));
    const T valid = make();
    std::memcpy(b.data(), &valid, std::min(size, sizeof(T)));
    b.as<T>()->struct_size = size;
    STRATA_REQUIRE_OK(call(b.as<T>()));
  }
  for (const std::size_t size : refused_sizes(r)) {
    INFO(r.type << " struct_size " << size);
    Buffer b(sizeof(T));
    const T valid = make();
    std::memcpy(b.data(), &valid, sizeof(T));  // every field valid: only the size is wrong
    b.as<T>()->struct_size = size;
    STRATA_REQUIRE_ERROR(call(b.as<T>()), STRATA_ERROR_INVALID_ARGUMENT, refusal(r, size));
    REQUIRE_THAT(strata_last_error_message(), Catch::Contains("accepted are"));
  }
}

// An output struct: written at most as far as its struct_size, which stays as the caller set
// it; nothing at all written when refused.
template <typename T>
void check_output(const char* type, const std::function<strata_status_t(T*)>& call) {
  const Row& r = row(type);
  exercised().insert(type);
  REQUIRE(r.current == r.released.back());
  for (const std::size_t size : accepted_sizes(r)) {
    INFO(r.type << " struct_size " << size);
    Buffer b(std::max(size, sizeof(T)));
    b.as<T>()->struct_size = size;
    STRATA_REQUIRE_OK(call(b.as<T>()));
    REQUIRE(b.as<T>()->struct_size == size);
    const std::size_t written = std::min(size, sizeof(T));
    const unsigned char* bytes = b.data();
    REQUIRE(std::any_of(bytes + sizeof(size_t), bytes + written,
                        [](unsigned char c) { return c != kSentinel; }));
    REQUIRE(std::all_of(bytes + written, bytes + b.bytes(),
                        [](unsigned char c) { return c == kSentinel; }));
  }
  for (const std::size_t size : refused_sizes(r)) {
    INFO(r.type << " struct_size " << size);
    Buffer b(sizeof(T));
    b.as<T>()->struct_size = size;
    STRATA_REQUIRE_ERROR(call(b.as<T>()), STRATA_ERROR_INVALID_ARGUMENT, refusal(r, size));
    REQUIRE(b.as<T>()->struct_size == size);
    REQUIRE(std::all_of(b.data() + sizeof(size_t), b.data() + b.bytes(),
                        [](unsigned char c) { return c == kSentinel; }));
  }
}

}  // namespace

namespace {

const int64_t kShape[1] = {256};

strata_tensor_t* register_f32(strata_runtime_t* rt, const std::string& name, strata_role_t role) {
  const strata_tensor_desc_t d =
      desc(name.c_str(), kShape, 1, STRATA_TIER_DRAM, STRATA_DTYPE_F32, role);
  strata_tensor_t* t = nullptr;
  STRATA_REQUIRE_OK(strata_tensor_register(rt, &d, &t));
  return t;
}

// A host runtime with one layer (weight w, grad g) planned, an executor, and an optimizer over
// them attached in explicit mode.
struct Model {
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 16 * kMiB, 32 * kMiB));
  strata_tensor_t* w = register_f32(rt.get(), "w", STRATA_ROLE_WEIGHT);
  strata_tensor_t* g = register_f32(rt.get(), "w.grad", STRATA_ROLE_GRAD);
  strata_graph_t* graph = nullptr;
  strata_plan_t* plan = nullptr;
  strata_executor_t* ex = nullptr;
  strata_optimizer_t* opt = nullptr;
  std::deque<std::string> names;  // names and handles the structs made below point at
  std::deque<strata_tensor_t*> handles;

  Model() {
    STRATA_REQUIRE_OK(strata_graph_create(rt.get(), &graph));
    strata_layer_desc_t d{};
    d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
    d.weights = &w;
    d.weight_count = 1;
    d.grads = &g;
    d.grad_count = 1;
    STRATA_REQUIRE_OK(strata_graph_add_layer(graph, &d, nullptr));
    STRATA_REQUIRE_OK(strata_plan_create(graph, nullptr, &plan));
    STRATA_REQUIRE_OK(strata_executor_create(plan, &ex));
    strata_optimizer_config_t c;
    STRATA_REQUIRE_OK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &c));
    c.threads = 1;
    c.update_mode = STRATA_UPDATE_EXPLICIT;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &c, &opt));
    const strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, STRATA_MASTER_SEPARATE,
                                STRATA_GRAD_SUM_ACCUMULATOR};
    STRATA_REQUIRE_OK(strata_optimizer_add_param(opt, &p));
    STRATA_REQUIRE_OK(strata_optimizer_attach(opt, ex));
  }
  ~Model() {
    strata_optimizer_destroy(opt);
    strata_executor_destroy(ex);
    strata_plan_destroy(plan);
    strata_graph_destroy(graph);
  }
  strata_tensor_t* fresh(const char* prefix, strata_role_t role = STRATA_ROLE_WEIGHT) {
    names.push_back(prefix + std::to_string(names.size()));
    return register_f32(rt.get(), names.back(), role);
  }
};

void check_runtime_structs(Model& m) {
  check_input<strata_runtime_config_t>(
      "strata_runtime_config_t",
      [] { return config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, 8 * kMiB); },
      [](strata_runtime_config_t* c) {
        strata_runtime_t* r = nullptr;
        const strata_status_t s = strata_runtime_create(c, &r);
        strata_runtime_destroy(r);
        return s;
      });
  check_output<strata_capabilities_t>("strata_capabilities_t", [&](strata_capabilities_t* out) {
    return strata_runtime_capabilities(m.rt.get(), out);
  });
  check_output<strata_tier_usage_t>("strata_tier_usage_t", [&](strata_tier_usage_t* out) {
    return strata_runtime_tier_usage(m.rt.get(), STRATA_TIER_DRAM, out);
  });
  check_output<strata_link_stats_t>("strata_link_stats_t", [&](strata_link_stats_t* out) {
    return strata_runtime_link_stats(m.rt.get(), STRATA_LINK_H2D, out);
  });
  check_input<strata_tensor_desc_t>(
      "strata_tensor_desc_t",
      [&] {
        m.names.push_back("t" + std::to_string(m.names.size()));
        return desc(m.names.back().c_str(), kShape, 1, STRATA_TIER_DRAM);
      },
      [&](strata_tensor_desc_t* d) {
        strata_tensor_t* t = nullptr;
        return strata_tensor_register(m.rt.get(), d, &t);
      });
  check_output<strata_tensor_info_t>("strata_tensor_info_t", [&](strata_tensor_info_t* out) {
    return strata_tensor_get_info(m.rt.get(), m.w, out);
  });
  check_input<strata_trace_config_t>(
      "strata_trace_config_t",
      [] {
        return strata_trace_config_t{STRATA_TRACE_CONFIG_STRUCT_SIZE, 64};
      },
      [&](strata_trace_config_t* c) {
        const strata_status_t s = strata_trace_start(m.rt.get(), c);
        if (s == STRATA_OK) STRATA_REQUIRE_OK(strata_trace_stop(m.rt.get()));
        return s;
      });
  STRATA_REQUIRE_OK(strata_trace_start(m.rt.get(), nullptr));
  check_output<strata_trace_counters_t>(
      "strata_trace_counters_t",
      [&](strata_trace_counters_t* out) { return strata_trace_get_counters(m.rt.get(), out); });
  STRATA_REQUIRE_OK(strata_trace_stop(m.rt.get()));
}

void check_executor_structs(Model& m) {
  strata_graph_t* scratch = nullptr;  // takes the layers added below
  STRATA_REQUIRE_OK(strata_graph_create(m.rt.get(), &scratch));
  check_input<strata_layer_desc_t>(
      "strata_layer_desc_t",
      [&] {
        m.handles.push_back(m.fresh("l"));
        strata_layer_desc_t d{};
        d.struct_size = STRATA_LAYER_DESC_STRUCT_SIZE;
        d.weights = &m.handles.back();
        d.weight_count = 1;
        d.forward_flops = d.backward_flops = 1e6;
        return d;
      },
      [&](strata_layer_desc_t* d) { return strata_graph_add_layer(scratch, d, nullptr); });
  strata_graph_destroy(scratch);
  check_input<strata_plan_config_t>(
      "strata_plan_config_t",
      [] {
        strata_plan_config_t c;
        strata_plan_config_init(&c);
        return c;
      },
      [&](strata_plan_config_t* c) {
        strata_plan_t* p = nullptr;
        const strata_status_t s = strata_plan_create(m.graph, c, &p);
        strata_plan_destroy(p);
        return s;
      });
  check_output<strata_plan_info_t>("strata_plan_info_t", [&](strata_plan_info_t* out) {
    return strata_plan_get_info(m.plan, out);
  });
  check_output<strata_layer_views_t>("strata_layer_views_t", [&](strata_layer_views_t* out) {
    STRATA_REQUIRE_OK(strata_step_begin(m.ex));
    const strata_status_t s =
        strata_layer_acquire(m.ex, 0, STRATA_PHASE_FORWARD, nullptr, STRATA_ACQUIRE_DEFAULT, out);
    if (s == STRATA_OK) {
      STRATA_REQUIRE_OK(strata_layer_release(m.ex, 0, STRATA_PHASE_FORWARD, nullptr));
    }
    STRATA_REQUIRE_OK(strata_step_abort(m.ex, nullptr));
    return s;
  });
  check_output<strata_executor_stats_t>(
      "strata_executor_stats_t",
      [&](strata_executor_stats_t* out) { return strata_executor_get_stats(m.ex, out); });
}

void check_optimizer_structs(Model& m) {
  check_input<strata_optimizer_config_t>(
      "strata_optimizer_config_t",
      [] {
        strata_optimizer_config_t c;
        strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &c);
        c.threads = 1;
        return c;
      },
      [&](strata_optimizer_config_t* c) {
        strata_optimizer_t* o = nullptr;
        const strata_status_t s = strata_optimizer_create(m.rt.get(), c, &o);
        strata_optimizer_destroy(o);
        return s;
      });
  strata_optimizer_t* unattached = nullptr;  // takes the params added below
  STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), nullptr, &unattached));
  check_input<strata_param_desc_t>(
      "strata_param_desc_t",
      [&] {
        return strata_param_desc_t{STRATA_PARAM_DESC_STRUCT_SIZE,
                                   m.fresh("p"),
                                   m.fresh("p.grad", STRATA_ROLE_GRAD),
                                   0,
                                   STRATA_MASTER_SEPARATE,
                                   STRATA_GRAD_SUM_ACCUMULATOR};
      },
      [&](strata_param_desc_t* p) { return strata_optimizer_add_param(unattached, p); });
  strata_optimizer_destroy(unattached);
  check_input<strata_group_hyperparams_t>(
      "strata_group_hyperparams_t",
      [] {
        return strata_group_hyperparams_t{
            STRATA_GROUP_HYPERPARAMS_STRUCT_SIZE, 1e-3f, 0.f, 0.9f, 0.999f, 1e-8f};
      },
      [&](strata_group_hyperparams_t* h) {
        return strata_optimizer_set_group_hyperparams(m.opt, 1, h);
      });
  check_output<strata_group_hyperparams_t>(
      "strata_group_hyperparams_t",
      [&](strata_group_hyperparams_t* out) { return strata_optimizer_get_group(m.opt, 1, out); });
  check_output<strata_grad_info_t>("strata_grad_info_t", [&](strata_grad_info_t* out) {
    return strata_optimizer_grad_info(m.opt, m.w, out);
  });
  check_output<strata_optimizer_stats_t>(
      "strata_optimizer_stats_t",
      [&](strata_optimizer_stats_t* out) { return strata_optimizer_get_stats(m.opt, out); });
}

void check_placement_structs() {
  const auto layer = [] {
    strata_placement_layer_t l;
    strata_placement_layer_init(&l);
    l.weight_bytes = l.grad_bytes = kMiB;
    l.state_bytes = 6 * kMiB;
    l.update_elements = kMiB / 2;
    return l;
  };
  const strata_placement_layer_t valid_layer = layer();
  const strata_placement_layer_t* layers[1] = {&valid_layer};
  const auto request = [&] {
    strata_placement_request_t q;
    strata_placement_request_init(&q);
    q.layers = layers;
    q.layer_count = 1;
    q.dram_budget_bytes = 64 * kMiB;
    return q;
  };
  const auto place = [](const strata_placement_request_t* q) {
    strata_placement_t* p = nullptr;
    const strata_status_t s = strata_placement_create(nullptr, q, &p);
    strata_placement_destroy(p);
    return s;
  };
  check_input<strata_placement_layer_t>("strata_placement_layer_t", layer,
                                        [&](strata_placement_layer_t* l) {
                                          const strata_placement_layer_t* one[1] = {l};
                                          strata_placement_request_t q = request();
                                          q.layers = one;
                                          return place(&q);
                                        });
  check_input<strata_placement_request_t>("strata_placement_request_t", request, place);
  const strata_placement_request_t q = request();
  strata_placement_t* p = nullptr;
  STRATA_REQUIRE_OK(strata_placement_create(nullptr, &q, &p));
  check_output<strata_placement_info_t>(
      "strata_placement_info_t",
      [&](strata_placement_info_t* out) { return strata_placement_get_info(p, out); });
  strata_placement_destroy(p);
}

void check_layout_structs() {
  const uint32_t counts[1] = {2};
  const uint64_t elements[2] = {1000, 2000};
  const auto request = [&] {
    strata_layout_request_t q;
    strata_layout_request_init(&q);
    q.layer_count = 1;
    q.trainable_counts = counts;
    q.trainable_elements = elements;
    return q;
  };
  check_input<strata_layout_request_t>("strata_layout_request_t", request,
                                       [](strata_layout_request_t* q) {
                                         strata_layout_totals_t totals{};
                                         totals.struct_size = STRATA_LAYOUT_TOTALS_STRUCT_SIZE;
                                         return strata_layout_query(q, nullptr, &totals);
                                       });
  const strata_layout_request_t q = request();
  check_output<strata_layout_layer_t>("strata_layout_layer_t", [&](strata_layout_layer_t* out) {
    return strata_layout_query(&q, out, nullptr);
  });
  check_output<strata_layout_totals_t>("strata_layout_totals_t", [&](strata_layout_totals_t* out) {
    return strata_layout_query(&q, nullptr, out);
  });
}

void check_step_plan_structs() {
  strata_step_block_t valid_block;
  strata_step_block_init(&valid_block);
  valid_block.elements = 1000;
  valid_block.residency = STRATA_RESIDENCY_STREAMED;
  strata_step_interval_t valid_interval;
  strata_step_interval_init(&valid_interval);
  const strata_step_block_t* blocks[1] = {&valid_block};
  const strata_step_interval_t* intervals[1] = {&valid_interval};
  const auto profile = [&] {
    strata_step_profile_t p;
    strata_step_profile_init(&p);
    p.blocks = blocks;
    p.block_count = 1;
    p.intervals = intervals;
    p.interval_count = 1;
    p.flags = STRATA_STEP_PLAN_KEPT;
    p.device_total_bytes = 1 << 30;
    return p;
  };
  const auto plan = [](const strata_step_profile_t* p) {
    strata_step_plan_t* made = nullptr;
    const strata_status_t s = strata_step_plan_create(p, &made);
    strata_step_plan_destroy(made);
    return s;
  };
  check_input<strata_step_profile_t>("strata_step_profile_t", profile, plan);
  check_input<strata_step_block_t>(
      "strata_step_block_t", [&] { return valid_block; },
      [&](strata_step_block_t* b) {
        const strata_step_block_t* one[1] = {b};
        strata_step_profile_t p = profile();
        p.blocks = one;
        return plan(&p);
      });
  check_input<strata_step_interval_t>(
      "strata_step_interval_t", [&] { return valid_interval; },
      [&](strata_step_interval_t* t) {
        const strata_step_interval_t* one[1] = {t};
        strata_step_profile_t p = profile();
        p.intervals = one;
        return plan(&p);
      });
  const strata_step_profile_t p = profile();
  strata_step_plan_t* made = nullptr;
  STRATA_REQUIRE_OK(strata_step_plan_create(&p, &made));
  check_output<strata_step_plan_info_t>(
      "strata_step_plan_info_t",
      [&](strata_step_plan_info_t* out) { return strata_step_plan_get_info(made, out); });
  check_output<strata_step_block_t>("strata_step_block_t", [&](strata_step_block_t* out) {
    return strata_step_plan_get_block(made, 0, out);
  });
  strata_step_plan_destroy(made);
}

void check_host_buffer_structs() {
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, 8 * kMiB));
  STRATA_REQUIRE_OK(strata_runtime_set_host_budget(rt.get(), 9 * kMiB));
  check_output<strata_host_usage_t>("strata_host_usage_t", [&](strata_host_usage_t* out) {
    return strata_runtime_host_usage(rt.get(), out);
  });
  check_input<strata_host_buffer_desc_t>(
      "strata_host_buffer_desc_t",
      [] {
        return strata_host_buffer_desc_t{STRATA_HOST_BUFFER_DESC_STRUCT_SIZE, 4096, "x"};
      },
      [&](strata_host_buffer_desc_t* d) {
        strata_host_buffer_t* b = nullptr;
        const strata_status_t s = strata_host_buffer_create(rt.get(), d, &b);
        if (s == STRATA_OK) STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), b));
        return s;
      });
  const strata_host_buffer_desc_t d{STRATA_HOST_BUFFER_DESC_STRUCT_SIZE, 4096, "x"};
  strata_host_buffer_t* b = nullptr;
  STRATA_REQUIRE_OK(strata_host_buffer_create(rt.get(), &d, &b));
  check_output<strata_host_buffer_info_t>("strata_host_buffer_info_t",
                                          [&](strata_host_buffer_info_t* out) {
                                            return strata_host_buffer_get_info(rt.get(), b, out);
                                          });
  STRATA_REQUIRE_OK(strata_host_buffer_free(rt.get(), b));
}

}  // namespace

TEST_CASE("struct_size: every struct takes its released sizes and newer ones, nothing else",
          "[abi][struct_size]") {
  {
    Model m;
    check_runtime_structs(m);
    check_executor_structs(m);
    check_optimizer_structs(m);
  }
  check_placement_structs();
  check_layout_structs();
  check_step_plan_structs();
  check_host_buffer_structs();
  std::set<std::string> all;
  for (const Row& r : kRows) all.insert(r.type);
  REQUIRE(exercised() == all);
}

// The issue's cases, by name: a size one byte short of this header's ends inside the last field.
TEST_CASE("struct_size ending inside a field is INVALID_ARGUMENT, nothing written",
          "[abi][struct_size]") {
  strata_runtime_config_t c = config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, 8 * kMiB);
  c.struct_size = STRATA_RUNTIME_CONFIG_STRUCT_SIZE - 1;
  strata_runtime_t* r = nullptr;
  STRATA_REQUIRE_ERROR(strata_runtime_create(&c, &r), STRATA_ERROR_INVALID_ARGUMENT,
                       "strata_runtime_config_t.struct_size is 103, not a size of any release: "
                       "accepted are 96, 104 or more");
  REQUIRE(r == nullptr);
  RuntimePtr rt = make_runtime(config_for(STRATA_DEVICE_BACKEND_HOST, 4 * kMiB, 8 * kMiB));
  strata_capabilities_t caps;
  std::memset(&caps, kSentinel, sizeof caps);
  caps.struct_size = STRATA_CAPABILITIES_STRUCT_SIZE - 1;
  STRATA_REQUIRE_ERROR(strata_runtime_capabilities(rt.get(), &caps), STRATA_ERROR_INVALID_ARGUMENT,
                       "strata_capabilities_t.struct_size is 823, not a size of any release: "
                       "accepted are 816, 824 or more");
  REQUIRE(caps.dram_pinned_bytes == 0xA5A5A5A5A5A5A5A5ull);
  REQUIRE(caps.device_backend == static_cast<int32_t>(0xA5A5A5A5u));
}

// Every STRATA_*_STRUCT_SIZE of the header has a row above, whose last size is the macro's.
TEST_CASE("struct_size: the rows cover every struct of strata.h", "[abi][struct_size]") {
  std::ifstream in(STRATA_HEADER_PATH);
  REQUIRE(in);
  std::stringstream text;
  text << in.rdbuf();
  const std::string header = text.str();
  const std::regex macro(R"(#define\s+(STRATA_[A-Z0-9_]+_STRUCT_SIZE)\b)");
  std::set<std::string> in_header;
  for (auto it = std::sregex_iterator(header.begin(), header.end(), macro);
       it != std::sregex_iterator(); ++it) {
    in_header.insert((*it)[1]);
  }
  std::set<std::string> in_rows;
  for (const Row& r : kRows) {
    in_rows.insert(r.macro);
    INFO(r.type);
    REQUIRE(std::is_sorted(r.released.begin(), r.released.end()));
    REQUIRE(std::adjacent_find(r.released.begin(), r.released.end()) == r.released.end());
    REQUIRE(r.released.back() == r.current);
  }
  REQUIRE(in_header.size() == std::size(kRows));
  REQUIRE(in_header == in_rows);
}
