#include "runtime/optimizer/layout_sizes.h"

#include <algorithm>

#include "runtime/memory/arena.h"
#include "runtime/nvme/nvme_tier.h"

namespace strata {

// The DRAM arena (runtime.cpp) and the NVMe extents are allocated in these blocks.
static_assert(kLayoutPage == NvmeTier::kAlignment);

namespace {
// The default DRAM budget with state on NVMe keeps this beyond the tensors' own blocks: the
// optimizer's buffers round to pages, and the arena must keep room to lay them out.
constexpr uint64_t kDramMargin = 16ull << 20;
// The NVMe tier holds what a placement puts there plus this headroom: 64 MiB a layer and 5%
// (strata.torch's policy since 1.2, moved here unchanged so every caller reserves the same; the
// extents themselves need only 4 KiB rounding, which the layout's counts already exceed).
constexpr uint64_t kNvmeMarginPerLayer = 64ull << 20;
constexpr uint64_t kNvmeSlackPercent = 5;
// The default budgets without NVMe (strata.torch's and strata.jax's when none is given): DRAM
// for every tensor with 2% for the arena's page rounding and 256 MiB of headroom (1 MiB more
// beside the grad fetch buffer); HBM for 4 slots of a layer's weights and grad buffers, and 64
// MiB for the planner's margin; HBM-homed grads 1% and 64 KiB a layer for the HBM arena's
// per-tensor alignment.
constexpr uint64_t kStreamingDramHeadroom = 256ull << 20;
constexpr uint64_t kStreamingFetchHeadroom = 1ull << 20;
constexpr uint64_t kStreamingSlots = 4;
constexpr uint64_t kStreamingHbmHeadroom = 64ull << 20;
constexpr uint64_t kHbmGradHeadroom = 64ull << 10;

// A DRAM tensor's arena block and a page beside it: what a layout counts per weight or grad,
// so a placement never counts less DRAM than the registrations take.
uint64_t dram_tensor_bytes(uint64_t bytes) {
  return Arena::round_up(bytes, kLayoutPage) + kLayoutPage;
}

// floor(bytes * 100 / (100 + kNvmeSlackPercent)) for any 64-bit `bytes`.
uint64_t without_slack(uint64_t bytes) {
  constexpr uint64_t d = 100 + kNvmeSlackPercent;
  return bytes / d * 100 + bytes % d * 100 / d;  // bytes = q d + r: 100 q + floor(100 r / d)
}
}  // namespace

uint64_t state_bytes_per_element(bool exp_avg, bool exp_avg_sq, DType weight_dtype,
                                 bool split_master) {
  const bool has_master = weight_dtype != DType::kF32;
  return (has_master ? (split_master ? 2 : 4) : 0) + (exp_avg ? 4 : 0) + (exp_avg_sq ? 4 : 0);
}

uint64_t planned_state_bytes(uint64_t state_bytes) {
  return state_bytes + state_bytes / 64 + 3 * 8192;
}

uint64_t accum_dram_bytes(uint64_t elements) {
  return dram_tensor_bytes(elements * sizeof(float));
}

uint64_t accum_nvme_bytes(uint64_t elements) {
  return Arena::round_up(elements * sizeof(float), kLayoutPage);
}

uint64_t grad_fetch_span(uint64_t elements, std::size_t element_size) {
  return Arena::round_up(elements * element_size, kGradFetchAlignment);
}

Status compute_layout(const LayoutRequest& r, std::vector<LayoutLayer>* layers,
                      LayoutTotals* totals) {
  const std::size_t n = r.trainable.size();
  if (n == 0) return error(Code::kInvalidArgument, "the layout request has no layers");
  if (n > kMaxLayoutLayers) {
    return error(Code::kInvalidArgument, "the layout request has ", n, " layers; at most ",
                 kMaxLayoutLayers);
  }
  if (!r.frozen.empty() && r.frozen.size() != n) {
    return error(Code::kInvalidArgument, "frozen tensors are given for ", r.frozen.size(),
                 " layers, trainable ones for ", n);
  }
  if (r.dtype != DType::kF32 && r.dtype != DType::kBF16 && r.dtype != DType::kF16) {
    return error(Code::kInvalidArgument, "dtype ", dtype_name(r.dtype),
                 ": the optimizer takes f32, bf16 or f16 weights and grads");
  }
  if (r.split_master && r.dtype == DType::kF16) {
    return error(Code::kInvalidArgument,
                 "a split master needs bf16 weights (the upper half of an fp32), not f16");
  }
  if (r.grad_sums_in_place && !r.grads_in_hbm) {
    return error(Code::kInvalidArgument,
                 "in-place gradient sums (STRATA_GRAD_SUM_IN_PLACE) are the grads' HBM homes: "
                 "they need grad_tier STRATA_TIER_HBM, not DRAM");
  }
  uint64_t tensors = 0, elements = 0;
  for (std::size_t i = 0; i < n; ++i) {
    for (const auto* list : {&r.trainable[i], r.frozen.empty() ? nullptr : &r.frozen[i]}) {
      if (list == nullptr) continue;
      tensors += list->size();
      for (uint64_t e : *list) {
        // Checked one at a time: the sum of two bounded counts cannot wrap.
        if (e > kMaxLayoutElements || (elements += e) > kMaxLayoutElements) {
          return error(Code::kInvalidArgument, "the layout request's tensors hold more than ",
                       kMaxLayoutElements, " (2^44) elements");
        }
      }
    }
    if (tensors > kMaxLayoutTensors) {
      return error(Code::kInvalidArgument, "the layout request has more than ", kMaxLayoutTensors,
                   " (2^24) tensors");
    }
  }
  const uint64_t es = dtype_size(r.dtype);
  // In-place sums: the HBM grad is the fp32 sum (what the optimizer's fetch buffer then holds
  // too), and no accumulator exists.
  const uint64_t gs = r.grad_sums_in_place ? sizeof(float) : es;
  const uint64_t per =
      state_bytes_per_element(r.adamw || r.momentum, r.adamw, r.dtype, r.split_master);
  LayoutTotals t;
  t.state_bytes_per_element = per;
  layers->assign(n, LayoutLayer{});
  uint64_t largest_layer = 0, streamed_bytes = 0, trained_bytes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    LayoutLayer& l = (*layers)[i];
    uint64_t all = 0, fetch = 0, grads = 0;
    for (uint64_t e : r.trainable[i]) {
      all += e;
      grads += e * gs;
      l.update_elements += e;
      if (!r.grad_sums_in_place) t.accum_bytes += accum_dram_bytes(e);
      l.weight_bytes += dram_tensor_bytes(e * es);
      if (!r.grads_in_hbm) l.grad_bytes += dram_tensor_bytes(e * es);
      fetch += grad_fetch_span(e, gs);
      if (per != 0) l.state_bytes += planned_state_bytes(e * per);
    }
    if (!r.frozen.empty()) {
      for (uint64_t e : r.frozen[i]) {
        all += e;
        l.weight_bytes += dram_tensor_bytes(e * es);
      }
    }
    if (r.grads_in_hbm) {
      // The fetch buffer is one arena block the size of the largest layer's spans; a layer
      // counts that block and a page, as a weight does.
      l.grad_bytes = fetch == 0 ? 0 : dram_tensor_bytes(fetch);
      l.grad_hbm_bytes = grads + grads / 100 + kHbmGradHeadroom;
      t.grad_fetch_bytes = std::max(t.grad_fetch_bytes, l.grad_bytes);
      t.grad_hbm_bytes += l.grad_hbm_bytes;
    } else {
      t.grad_dram_bytes += l.grad_bytes;
    }
    t.weight_bytes += l.weight_bytes;
    t.state_bytes += l.state_bytes;
    t.slot_bytes = std::max(t.slot_bytes, l.state_bytes);
    t.update_elements += l.update_elements;
    largest_layer = std::max(largest_layer, all);
    streamed_bytes += all * es;
    trained_bytes += l.update_elements * ((r.grads_in_hbm ? 0 : es) + per);
  }
  t.dram_margin_bytes = kDramMargin;
  t.dram_bytes = t.weight_bytes + t.state_bytes + t.grad_dram_bytes + t.grad_fetch_bytes +
                 uint64_t{r.staging_slots} * t.slot_bytes + kDramMargin;
  // The pinned arena holds every role but the optimizer's state (Runtime::dram_parts_for): the
  // weights and grads the GPU copies; the state, its staging slots and the accumulators are
  // the CPU's and go unpinned. The margin covers the pinned side's page rounding too.
  t.dram_gpu_bytes = t.weight_bytes + t.grad_dram_bytes + t.grad_fetch_bytes + kDramMargin;
  const uint64_t tensor_bytes = streamed_bytes + trained_bytes;
  t.streaming_dram_bytes = tensor_bytes + tensor_bytes / 50 + kStreamingDramHeadroom;
  t.streaming_hbm_bytes = 2 * kStreamingSlots * es * largest_layer + kStreamingHbmHeadroom;
  if (r.grads_in_hbm) {
    t.streaming_dram_bytes += t.grad_fetch_bytes + kStreamingFetchHeadroom;
    t.streaming_hbm_bytes += t.grad_hbm_bytes;
  }
  t.nvme_margin_bytes = kNvmeMarginPerLayer * n;
  // Accumulators spill too (the optimizer puts them on NVMe when DRAM has no room for them at
  // the first accumulation): the default NVMe budget holds them beside the state.
  const uint64_t spillable = t.weight_bytes + t.state_bytes + t.accum_bytes;
  t.nvme_bytes = (spillable * (100 + kNvmeSlackPercent) + 99) / 100 + t.nvme_margin_bytes;
  const uint64_t budget = r.nvme_budget != 0 ? r.nvme_budget : t.nvme_bytes;
  t.nvme_placeable_bytes =
      budget > t.nvme_margin_bytes ? without_slack(budget - t.nvme_margin_bytes) : 0;
  *totals = t;
  return Status::ok();
}

}  // namespace strata
