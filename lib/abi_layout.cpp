// C ABI: layout sizes (what a streamed model's tensors take of each tier), over
// runtime/optimizer/layout_sizes.h, the one copy of those rules.
#include <cstring>

#include "lib/abi_support.h"
#include "runtime/optimizer/layout_sizes.h"

using namespace strata;
using namespace strata::abi;

// The layer array is stepped through by its struct_size: that is sizeof only while every field
// is 8 bytes wide (strata.h promises it for appended fields too).
static_assert(sizeof(strata_layout_layer_t) == STRATA_LAYOUT_LAYER_STRUCT_SIZE);
static_assert(sizeof(uint64_t) == sizeof(size_t));

namespace {

// 1.5 appended the request's grad_sum: a 1.3 or 1.4 caller's request (abi_struct_sizes.h) is
// smaller than this header's struct.
static_assert(sizeof(strata_layout_request_t) > kLayoutRequestV1_3Size);

// One layer's element counts: `count` entries of `elements` from *next on.
Status read_counts(const uint32_t* counts, const uint64_t* elements, const char* what,
                   uint32_t layer, uint64_t* next, std::vector<uint64_t>* out) {
  const uint64_t count = counts[layer];
  if (count == 0) return Status::ok();
  if (elements == nullptr) {
    return error(Code::kInvalidArgument, what, "_elements is NULL and layer ", layer, " has ",
                 count, " ", what, " tensors");
  }
  if (*next + count > kMaxLayoutTensors) {  // before reading past what any caller could hold
    return error(Code::kInvalidArgument, "the layout request has more than ", kMaxLayoutTensors,
                 " (2^24) tensors");
  }
  out->assign(elements + *next, elements + *next + count);
  *next += count;
  return Status::ok();
}

Status to_request(const strata_layout_request_t& q, LayoutRequest* r) {
  if (q.layer_count == 0) return error(Code::kInvalidArgument, "the layout request has no layers");
  if (q.layer_count > kMaxLayoutLayers) {  // before reading any count
    return error(Code::kInvalidArgument, "the layout request has ", q.layer_count,
                 " layers; at most ", kMaxLayoutLayers);
  }
  if (q.trainable_counts == nullptr) {
    return error(Code::kInvalidArgument, "trainable_counts is NULL");
  }
  if (q.dtype < 0 || q.dtype >= STRATA_DTYPE_COUNT) {
    return error(Code::kInvalidArgument, "unknown dtype ", q.dtype);
  }
  r->dtype = static_cast<DType>(q.dtype);
  if (!known_kind(q.optimizer)) {
    return error(Code::kInvalidArgument, "unknown optimizer kind ", q.optimizer,
                 " (STRATA_OPTIMIZER_ADAMW 0 to STRATA_OPTIMIZER_ADAGRAD 4)");
  }
  // The state the kind keeps, by the optimizer's own rule (sgd_momentum: SGD's buffer).
  const StateSet kept =
      state_set(static_cast<OptimizerKind>(q.optimizer), q.sgd_momentum != 0 ? 1.f : 0.f);
  r->adamw = kept.exp_avg_sq != nullptr && kept.exp_avg != nullptr;
  r->momentum = !r->adamw && (kept.exp_avg != nullptr || kept.exp_avg_sq != nullptr);
  if (q.master_layout != STRATA_MASTER_SEPARATE && q.master_layout != STRATA_MASTER_SPLIT) {
    return error(Code::kInvalidArgument, "unknown master_layout ", q.master_layout,
                 " (STRATA_MASTER_SEPARATE 0, STRATA_MASTER_SPLIT 1)");
  }
  r->split_master = q.master_layout == STRATA_MASTER_SPLIT;
  if (q.grad_tier != STRATA_TIER_DRAM && q.grad_tier != STRATA_TIER_HBM) {
    return error(Code::kInvalidArgument, "grad_tier ", q.grad_tier,
                 " is not STRATA_TIER_DRAM (1) or STRATA_TIER_HBM (0)");
  }
  r->grads_in_hbm = q.grad_tier == STRATA_TIER_HBM;
  if (q.grad_sum != STRATA_GRAD_SUM_ACCUMULATOR && q.grad_sum != STRATA_GRAD_SUM_IN_PLACE) {
    return error(Code::kInvalidArgument, "unknown grad_sum ", q.grad_sum,
                 " (STRATA_GRAD_SUM_ACCUMULATOR 0, STRATA_GRAD_SUM_IN_PLACE 1)");
  }
  r->grad_sums_in_place = q.grad_sum == STRATA_GRAD_SUM_IN_PLACE;
  r->staging_slots = q.staging_slots;
  r->nvme_budget = q.nvme_budget_bytes;
  r->trainable.resize(q.layer_count);
  if (q.frozen_counts != nullptr) r->frozen.resize(q.layer_count);
  uint64_t next_trainable = 0, next_frozen = 0;
  for (uint32_t i = 0; i < q.layer_count; ++i) {
    STRATA_RETURN_IF_ERROR(read_counts(q.trainable_counts, q.trainable_elements, "trainable", i,
                                       &next_trainable, &r->trainable[i]));
    if (q.frozen_counts != nullptr) {
      STRATA_RETURN_IF_ERROR(read_counts(q.frozen_counts, q.frozen_elements, "frozen", i,
                                         &next_frozen, &r->frozen[i]));
    }
    if (next_trainable + next_frozen > kMaxLayoutTensors) {
      return error(Code::kInvalidArgument, "the layout request has more than ", kMaxLayoutTensors,
                   " (2^24) tensors");
    }
  }
  return Status::ok();
}

// Fill the first `bytes` bytes of *request with the defaults (LayoutRequest's, the one copy of
// them) and set struct_size.
strata_status_t layout_request_init(strata_layout_request_t* request, std::size_t bytes,
                                    std::size_t struct_size) {
  return guarded("strata_layout_request_init", [&] {
    STRATA_RETURN_IF_ERROR(require(request, "request"));
    const LayoutRequest defaults;
    strata_layout_request_t q{};
    q.dtype = static_cast<strata_dtype_t>(defaults.dtype);
    q.optimizer = defaults.adamw ? STRATA_OPTIMIZER_ADAMW : STRATA_OPTIMIZER_SGD;
    q.master_layout = defaults.split_master ? STRATA_MASTER_SPLIT : STRATA_MASTER_SEPARATE;
    q.grad_tier = defaults.grads_in_hbm ? STRATA_TIER_HBM : STRATA_TIER_DRAM;
    q.staging_slots = defaults.staging_slots;
    q.grad_sum =
        defaults.grad_sums_in_place ? STRATA_GRAD_SUM_IN_PLACE : STRATA_GRAD_SUM_ACCUMULATOR;
    std::memcpy(static_cast<void*>(request), &q, bytes);
    request->struct_size = struct_size;
    return Status::ok();
  });
}

}  // namespace

extern "C" {

// strata_layout_request_init writes the whole struct it knows, and 1.5's grad_sum made it grow
// from 80 to 88 bytes: programs linked against 1.3 or 1.4 keep an init that writes only their
// 80, the compat symbol strata_layout_request_init@STRATA_1.3; programs built against this
// header get the default, @@STRATA_1.5 (docs/abi.md, "*_config_init and growing structs").
STRATA_API strata_status_t strata_layout_request_init_v1_5(strata_layout_request_t* request) {
  return layout_request_init(request, sizeof *request, STRATA_LAYOUT_REQUEST_STRUCT_SIZE);
}

// strata_layout_request_init@STRATA_1.3, for programs linked against 1.3 or 1.4.
STRATA_API strata_status_t strata_layout_request_init_v1_3(strata_layout_request_t* request) {
  return layout_request_init(request, kLayoutRequestV1_3Size, kLayoutRequestV1_3Size);
}

STRATA_API strata_status_t strata_layout_query(const strata_layout_request_t* request,
                                               strata_layout_layer_t* layers,
                                               strata_layout_totals_t* totals) {
  return guarded(__func__, [&] {
    strata_layout_request_t q{};
    (void)strata_layout_request_init_v1_5(&q);
    STRATA_RETURN_IF_ERROR(read_struct(request, &q));
    // Every output struct is checked before anything is computed or written.
    std::size_t stride = 0;
    if (layers != nullptr) {
      STRATA_RETURN_IF_ERROR(check_out_struct(layers));
      stride = layers->struct_size;
      if (stride % alignof(strata_layout_layer_t) != 0) {
        return error(Code::kInvalidArgument, "strata_layout_layer_t.struct_size is ", stride,
                     ", not a multiple of ", alignof(strata_layout_layer_t));
      }
      if (q.layer_count > kMaxLayoutLayers) {
        return error(Code::kInvalidArgument, "the layout request has ", q.layer_count,
                     " layers; at most ", kMaxLayoutLayers);
      }
      auto* bytes = reinterpret_cast<unsigned char*>(layers);
      for (uint32_t i = 1; i < q.layer_count; ++i) {
        const auto* l = reinterpret_cast<const strata_layout_layer_t*>(bytes + i * stride);
        if (l->struct_size != stride) {
          return error(Code::kInvalidArgument, "layers[", i, "].struct_size is ", l->struct_size,
                       ", layers[0]'s ", stride, ": set every element's to one value");
        }
      }
    }
    if (totals != nullptr) {
      STRATA_RETURN_IF_ERROR(check_out_struct(totals));
    }
    LayoutRequest r;
    STRATA_RETURN_IF_ERROR(to_request(q, &r));
    std::vector<LayoutLayer> per_layer;
    LayoutTotals t;
    STRATA_RETURN_IF_ERROR(compute_layout(r, &per_layer, &t));
    if (layers != nullptr) {
      auto* bytes = reinterpret_cast<unsigned char*>(layers);
      for (std::size_t i = 0; i < per_layer.size(); ++i) {
        const LayoutLayer& l = per_layer[i];
        strata_layout_layer_t out{};
        out.weight_bytes = l.weight_bytes;
        out.grad_bytes = l.grad_bytes;
        out.grad_hbm_bytes = l.grad_hbm_bytes;
        out.state_bytes = l.state_bytes;
        out.update_elements = l.update_elements;
        write_struct(reinterpret_cast<strata_layout_layer_t*>(bytes + i * stride), out);
      }
    }
    if (totals != nullptr) {
      strata_layout_totals_t out{};
      out.weight_bytes = t.weight_bytes;
      out.grad_dram_bytes = t.grad_dram_bytes;
      out.grad_hbm_bytes = t.grad_hbm_bytes;
      out.grad_fetch_bytes = t.grad_fetch_bytes;
      out.state_bytes = t.state_bytes;
      out.slot_bytes = t.slot_bytes;
      out.update_elements = t.update_elements;
      out.state_bytes_per_element = t.state_bytes_per_element;
      out.dram_bytes = t.dram_bytes;
      out.dram_margin_bytes = t.dram_margin_bytes;
      out.streaming_dram_bytes = t.streaming_dram_bytes;
      out.streaming_hbm_bytes = t.streaming_hbm_bytes;
      out.nvme_margin_bytes = t.nvme_margin_bytes;
      out.nvme_bytes = t.nvme_bytes;
      out.nvme_placeable_bytes = t.nvme_placeable_bytes;
      out.accum_bytes = t.accum_bytes;
      out.dram_gpu_bytes = t.dram_gpu_bytes;
      write_struct(totals, out);
    }
    return Status::ok();
  });
}

}  // extern "C"

// The two definitions of strata_layout_request_init: their names stay local (lib/strata.map's
// `local: *`), the versioned aliases are exported.
asm(".symver strata_layout_request_init_v1_5, strata_layout_request_init@@STRATA_1.5");
asm(".symver strata_layout_request_init_v1_3, strata_layout_request_init@STRATA_1.3");
