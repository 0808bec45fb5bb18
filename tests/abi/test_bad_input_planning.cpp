// Bad input for the planning functions of the ABI (placement, the layout query): the right
// status, a message naming the problem, nothing written; good requests measure and choose.
#include <cmath>
#include <cstring>
#include <string>

#include "abi/bad_input.h"

using namespace strata_test;
using namespace strata_test::bad_input;

TEST_CASE("placement: bad requests are refused by name, good ones measure and choose",
          "[abi][placement]") {
  strata_placement_layer_t layers[3];
  const strata_placement_layer_t* pointers[3];
  for (int i = 0; i < 3; ++i) {
    STRATA_REQUIRE_OK(strata_placement_layer_init(&layers[i]));
    REQUIRE(layers[i].weight_tier == STRATA_HOME_CHOOSE);
    REQUIRE(layers[i].grad_tier == STRATA_TIER_DRAM);
    layers[i].weight_bytes = layers[i].grad_bytes = kMiB;
    layers[i].state_bytes = 6 * kMiB;
    layers[i].update_elements = kMiB / 2;
    pointers[i] = &layers[i];
  }
  strata_placement_request_t q;
  STRATA_REQUIRE_OK(strata_placement_request_init(&q));
  REQUIRE(q.struct_size == STRATA_PLACEMENT_REQUEST_STRUCT_SIZE);
  REQUIRE(q.max_staging_slots == 4);  // the defaults the header documents
  REQUIRE(q.prefetch_depth == 1);
  REQUIRE(q.updates_after_backward == 1);
  REQUIRE(q.staging_slots == 0);
  q.layers = pointers;
  q.layer_count = 3;
  q.dram_budget_bytes = 64 * kMiB;
  strata_placement_t* p = nullptr;
  STRATA_REQUIRE_ERROR(strata_placement_request_init(nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "request");
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, nullptr, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "NULL");
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &q, nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "out_placement");
  strata_placement_request_t small = q;
  small.struct_size = 8;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &small, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "struct_size");
  strata_placement_request_t none = q;
  none.layer_count = 0;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &none, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "no layers");
  strata_placement_request_t null_layers = q;
  null_layers.layers = nullptr;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &null_layers, &p),
                       STRATA_ERROR_INVALID_ARGUMENT, "layers is NULL");
  strata_placement_request_t nan = q;
  nan.nvme_read_bytes_per_second = std::nan("");
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &nan, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "finite");
  strata_placement_request_t mixed = q;
  mixed.nvme_mixed = 0.2;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &mixed, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "nvme_mixed 0.2");
  strata_placement_request_t slots = q;
  slots.staging_slots = 9;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &slots, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "staging_slots 9");
  layers[1].struct_size = 8;  // each layer's own struct_size is checked
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &q, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "strata_placement_layer_t.struct_size");
  layers[1].struct_size = STRATA_PLACEMENT_LAYER_STRUCT_SIZE;
  const strata_placement_layer_t* holes[3] = {&layers[0], nullptr, &layers[2]};
  strata_placement_request_t with_hole = q;
  with_hole.layers = holes;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &with_hole, &p),
                       STRATA_ERROR_INVALID_ARGUMENT, "layers[1] is NULL");
  layers[1].state_tier = 7;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &q, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "state tier 7");
  layers[1].state_tier = STRATA_HOME_CHOOSE;
  layers[1].grad_tier = STRATA_TIER_NVME;
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &q, &p), STRATA_ERROR_INVALID_ARGUMENT,
                       "grad tier 2");
  layers[1].grad_tier = STRATA_TIER_DRAM;
  strata_placement_request_t tight = q;
  tight.dram_budget_bytes = 8 * kMiB;  // everything needs 24 MiB, and there is no NVMe
  STRATA_REQUIRE_ERROR(strata_placement_create(nullptr, &tight, &p), STRATA_ERROR_OUT_OF_MEMORY,
                       "DRAM needs at least 25165824");
  REQUIRE(p == nullptr);

  // Without a runtime: nothing measured, all in DRAM (it fits).
  STRATA_REQUIRE_OK(strata_placement_create(nullptr, &q, &p));
  strata_placement_info_t info{};
  info.struct_size = STRATA_PLACEMENT_INFO_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_placement_get_info(p, &info));
  REQUIRE(info.layers == 3);
  REQUIRE(info.nvme_bytes == 0);
  REQUIRE(info.dram_bytes == 24 * kMiB);
  REQUIRE(info.grad_fetch_bytes == 0);
  REQUIRE(info.update_elements_per_second == 0);
  int32_t w = -5, s = -5;
  STRATA_REQUIRE_OK(strata_placement_get_layer(p, 2, &w, nullptr));
  REQUIRE(w == STRATA_TIER_DRAM);
  STRATA_REQUIRE_ERROR(strata_placement_get_layer(p, 3, &w, &s), STRATA_ERROR_INVALID_ARGUMENT,
                       "out of range");
  size_t n = 0;
  STRATA_REQUIRE_OK(strata_placement_dump(p, STRATA_PLAN_FORMAT_TEXT, nullptr, 0, &n));
  std::string text(n + 1, '\0');
  STRATA_REQUIRE_ERROR(strata_placement_dump(p, STRATA_PLAN_FORMAT_TEXT, text.data(), n, nullptr),
                       STRATA_ERROR_INVALID_ARGUMENT, "too small");
  STRATA_REQUIRE_OK(strata_placement_dump(p, STRATA_PLAN_FORMAT_TEXT, text.data(), n + 1, &n));
  REQUIRE_THAT(text, Catch::Contains("predicted step"));
  STRATA_REQUIRE_ERROR(strata_placement_dump(p, 5, nullptr, 0, &n), STRATA_ERROR_INVALID_ARGUMENT,
                       "unknown placement format 5");
  strata_placement_info_t short_info{};
  short_info.struct_size = 4;
  STRATA_REQUIRE_ERROR(strata_placement_get_info(p, &short_info), STRATA_ERROR_INVALID_ARGUMENT,
                       "struct_size");
  REQUIRE(strata_placement_destroy(p) == STRATA_OK);
  REQUIRE(strata_placement_destroy(nullptr) == STRATA_OK);

  // Grads in HBM: one layer's grads of DRAM to read them through, instead of every layer's.
  for (auto& l : layers) l.grad_tier = STRATA_TIER_HBM;
  STRATA_REQUIRE_OK(strata_placement_create(nullptr, &q, &p));
  STRATA_REQUIRE_OK(strata_placement_get_info(p, &info));
  REQUIRE(info.grad_fetch_bytes == kMiB);
  REQUIRE(info.dram_bytes == 22 * kMiB);
  REQUIRE(strata_placement_destroy(p) == STRATA_OK);
  for (auto& l : layers) l.grad_tier = STRATA_TIER_DRAM;

  // On a runtime with an NVMe tier: budgets from its tiers, every rate measured, and a DRAM
  // budget of 20 MiB with one staging slot puts the last two layers' state on NVMe (grads and
  // weights 6 MiB, a slot 6, one layer's state 6; the 2 MiB left keep part of layer 1's).
  ScratchDir scratch;
  const std::string file = scratch.file("tier");
  const char* paths[1] = {file.c_str()};
  strata_runtime_config_t c = config_for(STRATA_DEVICE_BACKEND_HOST, 8 * kMiB, 32 * kMiB);
  c.nvme_paths = paths;
  c.nvme_path_count = 1;
  c.nvme_budget_bytes = 64 * kMiB;
  RuntimePtr r = make_runtime(c);
  strata_placement_request_t on_runtime = q;
  on_runtime.dram_budget_bytes = 20 * kMiB;
  on_runtime.max_staging_slots = 1;
  on_runtime.nvme_budget_bytes = 0;  // the tier's free bytes
  STRATA_REQUIRE_OK(strata_placement_create(r.get(), &on_runtime, &p));
  STRATA_REQUIRE_OK(strata_placement_get_info(p, &info));
  REQUIRE(info.h2d_bytes_per_second > 0);
  REQUIRE(info.nvme_read_bytes_per_second > 0);
  REQUIRE(info.nvme_write_bytes_per_second > 0);
  REQUIRE(info.nvme_mixed >= 0.5);
  REQUIRE(info.nvme_mixed <= 1.0);
  REQUIRE(info.update_elements_per_second > 0);
  REQUIRE(info.dram_bytes == 20 * kMiB);
  REQUIRE(info.nvme_bytes == 10 * kMiB);
  REQUIRE(info.state_nvme_layers == 2);
  REQUIRE(info.staging_slots == 1);
  STRATA_REQUIRE_OK(strata_placement_get_layer(p, 2, nullptr, &s));
  REQUIRE(s == STRATA_TIER_NVME);  // the last layer's first
  STRATA_REQUIRE_OK(strata_placement_get_layer(p, 0, nullptr, &s));
  REQUIRE(s == STRATA_TIER_DRAM);
  strata_placement_destroy(p);
  // A DRAM budget of 0 is what the runtime's DRAM tier has free (32 MiB): all fits there, and
  // a runtime without an NVMe budget left leaves nothing to spill to.
  strata_placement_request_t from_tiers = q;
  from_tiers.dram_budget_bytes = 0;
  STRATA_REQUIRE_OK(strata_placement_create(r.get(), &from_tiers, &p));
  STRATA_REQUIRE_OK(strata_placement_get_info(p, &info));
  REQUIRE(info.nvme_bytes == 0);
  REQUIRE(info.dram_bytes == 24 * kMiB);
  strata_placement_destroy(p);
  RuntimePtr no_nvme = host_runtime();  // 64 MiB of DRAM, no NVMe tier
  strata_placement_request_t tight_host = q;
  tight_host.dram_budget_bytes = 8 * kMiB;
  STRATA_REQUIRE_ERROR(strata_placement_create(no_nvme.get(), &tight_host, &p),
                       STRATA_ERROR_OUT_OF_MEMORY, "an NVMe budget lets");
  tight_host.nvme_budget_bytes = 1ull << 30;  // a budget for a tier this runtime lacks: ignored
  STRATA_REQUIRE_ERROR(strata_placement_create(no_nvme.get(), &tight_host, &p),
                       STRATA_ERROR_OUT_OF_MEMORY, "an NVMe budget lets");
  // The measurement gave back what it borrowed.
  strata_tier_usage_t u{};
  u.struct_size = STRATA_TIER_USAGE_STRUCT_SIZE;
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(r.get(), STRATA_TIER_DRAM, &u));
  REQUIRE(u.used_bytes == 0);
  STRATA_REQUIRE_OK(strata_runtime_tier_usage(r.get(), STRATA_TIER_NVME, &u));
  REQUIRE(u.used_bytes == 0);
}

TEST_CASE("layout query: bad requests are refused by name and nothing is written", "[abi]") {
  STRATA_REQUIRE_ERROR(strata_layout_request_init(nullptr), STRATA_ERROR_INVALID_ARGUMENT,
                       "request");
  const uint32_t counts[2] = {2, 1};
  const uint64_t elements[3] = {1000, 2000, 3000};
  strata_layout_request_t q;
  STRATA_REQUIRE_OK(strata_layout_request_init(&q));
  REQUIRE(q.struct_size == STRATA_LAYOUT_REQUEST_STRUCT_SIZE);
  REQUIRE(q.dtype == STRATA_DTYPE_BF16);
  REQUIRE(q.optimizer == STRATA_OPTIMIZER_ADAMW);
  REQUIRE(q.grad_tier == STRATA_TIER_DRAM);
  REQUIRE(q.staging_slots == 4);
  q.layer_count = 2;
  q.trainable_counts = counts;
  q.trainable_elements = elements;
  strata_layout_layer_t layers[2];
  for (auto& l : layers) {
    std::memset(&l, 0xAB, sizeof l);
    l.struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE;
  }
  strata_layout_totals_t totals;
  std::memset(&totals, 0xAB, sizeof totals);
  totals.struct_size = STRATA_LAYOUT_TOTALS_STRUCT_SIZE;
  const auto untouched = [&] {
    for (const auto& l : layers) REQUIRE(l.weight_bytes == 0xABABABABABABABABull);
    REQUIRE(totals.weight_bytes == 0xABABABABABABABABull);
  };

  STRATA_REQUIRE_ERROR(strata_layout_query(nullptr, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "strata_layout_request_t pointer is NULL");
  strata_layout_request_t short_request = q;
  short_request.struct_size = STRATA_LAYOUT_REQUEST_STRUCT_SIZE - 8;
  STRATA_REQUIRE_ERROR(strata_layout_query(&short_request, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "struct_size");
  strata_layout_totals_t short_totals = totals;
  short_totals.struct_size = sizeof(size_t);
  STRATA_REQUIRE_ERROR(strata_layout_query(&q, layers, &short_totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "strata_layout_totals_t.struct_size");
  layers[1].struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE + 8;
  STRATA_REQUIRE_ERROR(strata_layout_query(&q, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "layers[1].struct_size");
  layers[1].struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE;
  layers[0].struct_size = 8;
  STRATA_REQUIRE_ERROR(strata_layout_query(&q, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "strata_layout_layer_t.struct_size");
  layers[0].struct_size = STRATA_LAYOUT_LAYER_STRUCT_SIZE;

  // A 1.3 caller's totals end at nvme_placeable_bytes (1.4 appended accum_bytes): accepted, and
  // nothing past its struct_size is written.
  strata_layout_totals_t v13_totals;
  std::memset(&v13_totals, 0xAB, sizeof v13_totals);
  v13_totals.struct_size = STRATA_STRUCT_SIZE(strata_layout_totals_t, nvme_placeable_bytes);
  REQUIRE(strata_layout_query(&q, layers, &v13_totals) == STRATA_OK);
  REQUIRE(v13_totals.nvme_placeable_bytes != 0xABABABABABABABABull);
  REQUIRE(v13_totals.accum_bytes == 0xABABABABABABABABull);
  REQUIRE(v13_totals.struct_size ==
          STRATA_STRUCT_SIZE(strata_layout_totals_t, nvme_placeable_bytes));
  for (auto& l : layers) std::memset(&l.weight_bytes, 0xAB, sizeof l.weight_bytes);

  strata_layout_request_t none = q;
  none.layer_count = 0;
  STRATA_REQUIRE_ERROR(strata_layout_query(&none, nullptr, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "no layers");
  strata_layout_request_t many = q;
  many.layer_count = 16385;
  STRATA_REQUIRE_ERROR(strata_layout_query(&many, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "at most 16384");
  strata_layout_request_t no_counts = q;
  no_counts.trainable_counts = nullptr;
  STRATA_REQUIRE_ERROR(strata_layout_query(&no_counts, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "trainable_counts is NULL");
  strata_layout_request_t no_elements = q;
  no_elements.trainable_elements = nullptr;
  STRATA_REQUIRE_ERROR(strata_layout_query(&no_elements, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "trainable_elements is NULL");
  strata_layout_request_t no_frozen = q;
  no_frozen.frozen_counts = counts;
  STRATA_REQUIRE_ERROR(strata_layout_query(&no_frozen, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "frozen_elements is NULL");
  strata_layout_request_t int8 = q;
  int8.dtype = STRATA_DTYPE_I8;
  STRATA_REQUIRE_ERROR(strata_layout_query(&int8, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "f32, bf16 or f16");
  strata_layout_request_t unknown = q;
  unknown.dtype = 99;
  STRATA_REQUIRE_ERROR(strata_layout_query(&unknown, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "unknown dtype 99");
  strata_layout_request_t kind = q;
  kind.optimizer = 5;
  STRATA_REQUIRE_ERROR(strata_layout_query(&kind, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "optimizer kind 5");
  strata_layout_request_t layout = q;
  layout.master_layout = 2;
  STRATA_REQUIRE_ERROR(strata_layout_query(&layout, layers, &totals), STRATA_ERROR_INVALID_ARGUMENT,
                       "master_layout 2");
  strata_layout_request_t split_f16 = q;
  split_f16.master_layout = STRATA_MASTER_SPLIT;
  split_f16.dtype = STRATA_DTYPE_F16;
  STRATA_REQUIRE_ERROR(strata_layout_query(&split_f16, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "not f16");
  strata_layout_request_t grad_tier = q;
  grad_tier.grad_tier = STRATA_TIER_NVME;
  STRATA_REQUIRE_ERROR(strata_layout_query(&grad_tier, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "grad_tier 2");
  // Element counts whose byte sums would wrap 64 bits are refused, one tensor or many.
  const uint64_t huge[3] = {UINT64_MAX, 1, 1};
  strata_layout_request_t overflow = q;
  overflow.trainable_elements = huge;
  STRATA_REQUIRE_ERROR(strata_layout_query(&overflow, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "2^44");
  const uint64_t large[3] = {1ull << 43, 1ull << 43, 1};
  overflow.trainable_elements = large;
  STRATA_REQUIRE_ERROR(strata_layout_query(&overflow, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "2^44");
  const uint32_t too_many[2] = {(1u << 24) + 1, 1};  // refused before any is read
  overflow.trainable_elements = elements;
  overflow.trainable_counts = too_many;
  STRATA_REQUIRE_ERROR(strata_layout_query(&overflow, layers, &totals),
                       STRATA_ERROR_INVALID_ARGUMENT, "2^24");
  untouched();

  // A good one: either output may be NULL, and a newer caller's larger totals are filled only
  // as far as this library's struct (its own fields stay as it set them).
  STRATA_REQUIRE_OK(strata_layout_query(&q, nullptr, nullptr));
  struct {
    strata_layout_totals_t totals;
    uint64_t appended;
  } newer;
  std::memset(&newer, 0xAB, sizeof newer);
  newer.totals.struct_size = sizeof newer;
  STRATA_REQUIRE_OK(strata_layout_query(&q, layers, &newer.totals));
  REQUIRE(newer.totals.struct_size == sizeof newer);
  REQUIRE(newer.appended == 0xABABABABABABABABull);
  REQUIRE(newer.totals.weight_bytes == layers[0].weight_bytes + layers[1].weight_bytes);
  REQUIRE(layers[0].update_elements == 3000);
  REQUIRE(layers[1].update_elements == 3000);
  REQUIRE(layers[1].struct_size == STRATA_LAYOUT_LAYER_STRUCT_SIZE);
}
