// Grads held per parameter, as p.grad in PyTorch (GradHold, docs/architecture.md): reading,
// scaling, writing and zeroing them, the fp32 accumulator, per-parameter update counts.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "runtime/optimizer/layout_sizes.h"
#include "runtime/optimizer/optimizer_internal.h"

namespace strata {

namespace {
// The staging slots plan_accumulators lays out when the accumulators are not all in DRAM: as
// many as the layout had (the placement's choice for the state), 2 where it had none (one
// slot's landing overlaps the next one's read), fewer when DRAM cannot hold them.
constexpr std::size_t kAccumSlots = 2;
// DRAM plan_accumulators leaves free beside the slots (the buffer's page rounding).
constexpr uint64_t kAccumMargin = 2 * kLayoutPage;

std::string mib(uint64_t bytes) {
  return std::to_string((bytes + (1ull << 20) - 1) >> 20) + " MiB";
}
}  // namespace

Status Optimizer::ensure_accum(Param& p, std::unique_lock<std::mutex>& lock) {
  if (p.accum != 0) return Status::ok();
  STRATA_RETURN_IF_ERROR(plan_accumulators(lock));
  if (p.accum == 0) {
    return error(Code::kInternal, "optimizer: a param has no accumulator after they were placed");
  }
  return Status::ok();
}

void Optimizer::drop_accumulators(std::size_t owned_before, std::size_t pinned_before) {
  while (pinned_.size() > pinned_before) {
    runtime_->unpin(pinned_.back());
    pinned_.pop_back();
  }
  while (owned_.size() > owned_before) {
    (void)runtime_->unregister(owned_.back());
    owned_.pop_back();
  }
  for (Param& p : params_) {
    p.accum = 0;
    p.accum_data = nullptr;
    p.nvme_accum = false;
  }
  state_bytes_ -= accum_dram_bytes_;
  nvme_state_bytes_ -= accum_nvme_bytes_;
  accum_dram_bytes_ = accum_nvme_bytes_ = 0;
}

Status Optimizer::plan_accumulators(std::unique_lock<std::mutex>& lock) {
  if (accum_planned_) return Status::ok();
  // Every param's at once, at the first accumulation: one placement for all of them (the
  // slots are laid out for it once), and nothing allocated for a run that never accumulates.
  // Queued and running jobs read every param's accumulator pointer (accum_ptr) without the
  // mutex: they finish first, so that setting them here races with none (TSan caught an update
  // of the previous step reading them while the DRAM placement wrote them). Once per
  // optimizer.
  STRATA_RETURN_IF_ERROR(drain(lock));
  const std::size_t layers = layer_params_.size();
  std::vector<uint64_t> dram_need(layers, 0), nvme_need(layers, 0);
  uint64_t total = 0, summed_elements = 0;
  for (std::size_t l = 0; l < layers; ++l) {
    for (std::size_t i : layer_params_[l]) {
      if (params_[i].in_place) continue;  // its HBM grad is its sum
      summed_elements += params_[i].arrays.count;
      dram_need[l] += accum_dram_bytes(params_[i].arrays.count);
      nvme_need[l] += accum_nvme_bytes(params_[i].arrays.count);
    }
    total += dram_need[l];
  }
  const std::size_t owned_before = owned_.size(), pinned_before = pinned_.size();
  // Registers the accumulators of the layers whose on_nvme[l] is (home == kNvme); the layer
  // whose registration failed in *failed_layer.
  auto place = [&](const std::vector<uint8_t>& on_nvme, Tier home,
                   std::size_t* failed_layer) -> Status {
    for (std::size_t l = 0; l < layers; ++l) {
      if ((on_nvme[l] != 0) != (home == Tier::kNvme)) continue;
      for (std::size_t i : layer_params_[l]) {
        Param& p = params_[i];
        if (p.in_place) continue;
        TensorRecord w;
        STRATA_RETURN_IF_ERROR(runtime_->info(p.weight, &w));
        void* data = nullptr;
        const uint64_t dram_before = state_bytes_, nvme_before = nvme_state_bytes_;
        Status s = make_state(w, ".grad_accum", kSkew[3], home, &p.accum, &data);
        accum_dram_bytes_ += state_bytes_ - dram_before;
        accum_nvme_bytes_ += nvme_state_bytes_ - nvme_before;
        if (!s.is_ok()) {
          *failed_layer = l;
          return s;
        }
        p.accum_data = static_cast<float*>(data);
        p.nvme_accum = home == Tier::kNvme;
      }
    }
    return Status::ok();
  };
  const TierUsage dram = runtime_->tier_usage(Tier::kDram);
  const uint64_t free = dram.budget - dram.used;
  const bool nvme = runtime_->tier_available(Tier::kNvme);
  // First choice: every accumulator in DRAM, beside whatever is there (no slot changes).
  Status first_error;
  std::size_t dram_failed = layers;
  if (total <= free) {
    std::size_t failed = layers;
    first_error = place(std::vector<uint8_t>(layers, 0), Tier::kDram, &failed);
    if (first_error.is_ok()) {
      accum_planned_ = true;
      return Status::ok();
    }
    drop_accumulators(owned_before, pinned_before);
    dram_failed = failed;  // fragmented: that layer's sums did not fit
  }
  auto no_room = [&](const std::string& why) {
    const uint64_t short_by = total > free ? total - free : 0;
    return error(
        Code::kOutOfMemory,
        "gradient accumulation (a backward pass onto grads not zeroed since the last "
        "one) needs an fp32 sum per parameter: ",
        total, " bytes (", mib(total), ") for ", params_.size() - in_place_params_,
        " params, and the DRAM tier has ", free, " of its ", dram.budget,
        " bytes free (largest block ", dram.largest_free, ")", why,
        ". Raise the DRAM budget by at least ", mib(short_by),
        " (strata.torch: host_budget=, which defaults to room for the sums when the "
        "host's available memory allows it), give the runtime an NVMe tier, where the "
        "last layers' sums are staged through DRAM (strata.torch: nvme=), keep the sums in "
        "place on the GPU instead, in the grads' HBM homes (STRATA_GRAD_SUM_IN_PLACE; "
        "strata.torch: offload(grads=\"device\", grad_dtype=torch.float32)), which takes ",
        summed_elements * 4, " bytes (", mib(summed_elements * 4),
        ") of HBM and frees these sums and the grads' DRAM, or leave more DRAM free (more "
        "resident blocks, which torch accumulates on the device)",
        first_error.is_ok() ? "" : "; DRAM: ", first_error.is_ok() ? "" : first_error.message());
  };
  if (!nvme) return no_room(": no NVMe tier to put them on");
  // With NVMe: the slots are laid out again (bigger: a layer's accumulators join its state);
  // nothing uses them (drained above).
  const uint64_t room = free + staging_bytes_;  // the current slots are given back first
  std::vector<uint64_t> state_slot(layers, 0);
  uint64_t largest_state = 0;
  for (std::size_t l = 0; l < layers && l < stages_.size(); ++l) {
    state_slot[l] = stages_[l].bytes;
    largest_state = std::max(largest_state, state_slot[l]);
  }
  // Which layers' sums go to NVMe: those that grow the slot least first (a layer whose state
  // is in DRAM: its sums alone; among equals the last layers, which the next forward pass
  // needs last), as few as let the rest, and the slots, fit in DRAM. A slot holds a layer's
  // staged state and sums at once (an update reads its grads from the sums).
  std::vector<std::size_t> order(layers);
  for (std::size_t l = 0; l < layers; ++l) order[l] = l;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    const uint64_t cx = state_slot[x] + nvme_need[x], cy = state_slot[y] + nvme_need[y];
    return cx != cy ? cx < cy : x > y;
  });
  const std::size_t had = slot_free_.size();
  const std::size_t want_slots = had != 0 ? had : kAccumSlots;
  std::vector<uint8_t> on_nvme(layers, 0);
  std::size_t slots = 0;
  uint64_t slot = 0;
  // A fragmented DRAM (the all-DRAM try failed at dram_failed): that layer goes first.
  if (dram_failed < layers) {
    order.erase(std::find(order.begin(), order.end(), dram_failed));
    order.insert(order.begin(), dram_failed);
  }
  for (std::size_t n = want_slots; n >= 1 && slots == 0; --n) {
    uint64_t in_dram = total, grown = largest_state;
    for (std::size_t j = 0; j < layers && slots == 0; ++j) {
      const std::size_t l = order[j];
      in_dram -= dram_need[l];
      grown = std::max(grown, state_slot[l] + nvme_need[l]);
      if (in_dram + n * grown + kAccumMargin <= room) {
        slots = n;
        slot = grown;
        std::fill(on_nvme.begin(), on_nvme.end(), uint8_t{0});
        for (std::size_t k = 0; k <= j; ++k) on_nvme[order[k]] = 1;
      }
    }
  }
  if (slots == 0) {
    // The least DRAM any choice needs: one slot of the largest staged state, or of the
    // cheapest layer's state and sums, beside every other layer's sums.
    uint64_t least = std::numeric_limits<uint64_t>::max();
    for (std::size_t l = 0; l < layers; ++l) {
      least = std::min(
          least, total - dram_need[l] + std::max(largest_state, state_slot[l] + nvme_need[l]));
    }
    return no_room(
        "; with the NVMe tier, the sums DRAM keeps and one staging slot for a "
        "layer's state and sums need at least " +
        std::to_string(least) + " bytes of the " + std::to_string(room) +
        " DRAM has free beside the other tensors");
  }
  for (int attempt = 0;; ++attempt) {
    // NVMe first, then the slots (one block: laid out before the DRAM sums split what is
    // free), then the DRAM sums in what is left.
    std::size_t failed = layers;
    Status s = place(on_nvme, Tier::kNvme, &failed);
    if (s.is_ok()) s = layout_stages(slots * slot + kLayoutPage, slots);
    if (s.is_ok()) s = place(on_nvme, Tier::kDram, &failed);
    if (s.is_ok()) break;
    drop_accumulators(owned_before, pinned_before);
    // The layout as it was, so the state on NVMe still updates.
    Status back = layout_stages();
    const bool dram_short =
        s.code() == Code::kOutOfMemory && failed < layers && on_nvme[failed] == 0 && attempt < 8;
    if (!dram_short || !back.is_ok()) {
      if (!back.is_ok()) fail(back);
      return s.code() == Code::kOutOfMemory ? no_room(std::string("; ") + s.message()) : s;
    }
    // Fragmented: that layer's sums too on NVMe (in a slot that may then grow).
    on_nvme[failed] = 1;
    slot = std::max(slot, state_slot[failed] + nvme_need[failed]);
  }
  accum_planned_ = true;
  return Status::ok();
}

Status Optimizer::held_grad(TensorId weight, std::unique_lock<std::mutex>& lock, Param** out,
                            const char* what) {
  if (!config_.explicit_updates) {
    return error(Code::kInvalidState,
                 "per-parameter grads exist in explicit update mode only (update_mode "
                 "STRATA_UPDATE_EXPLICIT); this optimizer updates from executor steps");
  }
  if (executor_ == nullptr) {
    return error(Code::kInvalidState, "per-parameter grads: the optimizer is not attached");
  }
  Param* param = nullptr;
  for (Param& p : params_) {
    if (p.weight == weight) param = &p;
  }
  if (param == nullptr)
    return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
  const auto layer = static_cast<std::size_t>(param->layer);
  if (param->in_place) STRATA_RETURN_IF_ERROR(wait_aborted_adds(layer, lock));
  // An accumulator on NVMe is current there once its last landing's write-back is done (no job
  // keeps one in a slot otherwise: read ahead is the state only).
  cv_.wait(lock, [&] {
    return !failure_.is_ok() ||
           (landing_[layer] == 0 && (!param->nvme_accum || layer >= stages_.size() ||
                                     stages_[layer].phase != StagePhase::kWriting));
  });
  STRATA_RETURN_IF_ERROR(failure_);
  STRATA_RETURN_IF_ERROR(sum_at_rest(*param, what));
  *out = param;
  return Status::ok();
}

Status Optimizer::sum_at_rest(const Param& p, const char* what) {
  const auto layer = static_cast<std::size_t>(p.layer);
  if (!p.in_place || backward_[layer] != Backward::kAcquired) return Status::ok();
  TensorRecord g;
  (void)runtime_->info(p.grad, &g);
  return error(Code::kInvalidState, what, ": grad '", g.spec.name,
               "' is an in-place gradient sum (STRATA_GRAD_SUM_IN_PLACE) and layer ", layer,
               " is acquired for its backward pass: the framework's adds into it are in flight; "
               "call it after the layer's release (or strata_step_abort)");
}

Status Optimizer::grad_info(TensorId weight, GradInfo* out) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p, "grad_info"));
  // An in-place sum since changed: measured on the pool (every unmeasured one with it).
  STRATA_RETURN_IF_ERROR(ensure_measured(*p, lock));
  out->has_grad = p->hold != GradHold::kNone;
  const double m = p->grad_mult;
  out->sum_squares =
      p->hold == GradHold::kNone || p->hold == GradHold::kZero ? 0.0 : p->grad_sq * m * m;
  out->step = p->t;
  return Status::ok();
}

Status Optimizer::grad_read(TensorId weight, float* dst, uint64_t count) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p, "grad_read"));
  if (count != p->arrays.count) {
    return error(Code::kInvalidArgument, "grad_read: ", count,
                 " elements asked, the parameter has ", p->arrays.count);
  }
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_read: the parameter holds no grad (zeroed to none)");
  }
  if (p->hold == GradHold::kZero) {
    std::fill(dst, dst + count, 0.f);
    return Status::ok();
  }
  if (p->hold == GradHold::kGrad && p->in_place) {
    // Through the fetch buffer into dst by a job on the pool (measured on the way: a clip that
    // reads p.grad first then needs no second copy out of HBM), nothing allocated here.
    return read_sum(*p, dst, lock);
  }
  optim::ParamArrays a;
  a.grad = p->hold == GradHold::kAccum ? static_cast<const void*>(p->accum_data) : p->arrays.grad;
  std::vector<unsigned char> fetched;  // an HBM-homed grad: copied here (the fetch buffer is
                                       // the dispatcher's)
  if (p->hold == GradHold::kAccum && p->nvme_accum) {
    Status s = runtime_->read(p->accum, 0, dst, count * sizeof(float));
    if (!s.is_ok()) return error(s.code(), "grad_read: the accumulator on NVMe: ", s.message());
    a.grad = dst;  // widened in place: a copy
  }
  if (p->hold == GradHold::kGrad && p->hbm_grad) {
    fetched.resize(count * dtype_size(p->arrays.grad_dtype));
    Status s = runtime_->backend()->copy_sync(fetched.data(), p->grad_device, fetched.size());
    if (!s.is_ok()) return error(s.code(), "grad_read: fetching the grad from HBM: ", s.message());
    a.grad = fetched.data();
  }
  a.grad_dtype = p->hold == GradHold::kAccum ? DType::kF32 : p->arrays.grad_dtype;
  a.grad_accum = dst;
  a.count = count;
  kernels_->accumulate(a, 0, count, true);  // widen to fp32 into dst
  if (p->grad_mult != 1.f) {
    for (uint64_t i = 0; i < count; ++i) dst[i] *= p->grad_mult;
  }
  return Status::ok();
}

Status Optimizer::grad_scale(TensorId weight, float factor) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p, "grad_scale"));
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_scale: the parameter holds no grad");
  }
  if (p->in_place && backward_[static_cast<std::size_t>(p->layer)] != Backward::kIdle) {
    // The factor applies lazily, to the sum; the landing of this backward pass will have added
    // grads it must not apply to, and nothing reads the sum in between to apply it first.
    TensorRecord g;
    (void)runtime_->info(p->grad, &g);
    return error(Code::kInvalidState, "grad_scale: grad '", g.spec.name,
                 "' is an in-place gradient sum (STRATA_GRAD_SUM_IN_PLACE) whose layer ", p->layer,
                 " has its backward pass loaded and not yet released: that pass adds its grads to "
                 "the sum, which the factor would then scale too; scale before the layer's "
                 "backward load or after its release");
  }
  p->grad_mult *= factor;
  return Status::ok();
}

Status Optimizer::grad_write(TensorId weight, const float* src, uint64_t count) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p, "grad_write"));
  if (count != p->arrays.count) {
    return error(Code::kInvalidArgument, "grad_write: ", count,
                 " elements given, the parameter has ", p->arrays.count);
  }
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_write: the parameter holds no grad (zeroed to none)");
  }
  // An update queued by step() reads the grad in the background: it must see the old values
  // whole, as torch's step() had finished reading p.grad before the user's next change.
  const auto layer = static_cast<std::size_t>(p->layer);
  cv_.wait(lock, [&] { return !failure_.is_ok() || pending_[layer] == 0; });
  STRATA_RETURN_IF_ERROR(failure_);
  STRATA_RETURN_IF_ERROR(sum_at_rest(*p, "grad_write"));  // the wait let another thread acquire
  optim::ParamArrays stored;  // what now holds the grad, for its sum of squares
  stored.count = count;
  std::vector<unsigned char> narrowed;  // an HBM-homed grad's values, on their way there
  if (p->in_place) {
    // The sum itself, exactly (the backward adds to it; an accumulator never holds it), through
    // the queue a zero fill of this step's backward load may still wait in.
    p->hold = GradHold::kGrad;
    Status s = write_sum(*p, src);
    if (!s.is_ok()) {
      mark_unknown(*p);
      return error(s.code(), "grad_write: ", s.message());
    }
    p->unknown = false;
    p->grad_mult = 1.f;
    p->measured = true;
    stored.grad = src;
    stored.grad_dtype = DType::kF32;
    p->grad_sq = kernels_->sum_squares(stored, 0, count);
    return Status::ok();
  }
  // Inside an executor step a zeroed grad's tensor is about to receive this step's backward
  // (which would replace what is written there): the accumulator takes it, and the landing adds.
  if (p->hold == GradHold::kAccum || (p->hold == GradHold::kZero && in_executor_step_)) {
    STRATA_RETURN_IF_ERROR(ensure_accum(*p, lock));
    if (p->nvme_accum) {
      Status s = runtime_->write(p->accum, 0, src, count * sizeof(float));
      if (!s.is_ok()) {
        p->grad_mult = 1.f;
        p->grad_sq = std::numeric_limits<double>::quiet_NaN();  // its values are unspecified
        return error(s.code(), "grad_write: the accumulator on NVMe: ", s.message());
      }
    } else {
      std::memcpy(p->accum_data, src, count * sizeof(float));
    }
    p->hold = GradHold::kAccum;
    stored.grad = src;  // what the accumulator now holds, exactly
    stored.grad_dtype = DType::kF32;
  } else {
    // The grad tensor, in its dtype: rounded by the kernel that rounds an update's working copy
    // (master_set; its master here is a scratch copy), so one rounding rule holds everywhere.
    const DType dtype = p->arrays.grad_dtype;
    const uint64_t bytes = count * dtype_size(dtype);
    void* dst = nullptr;
    if (p->hbm_grad) {
      narrowed.resize(bytes);
      dst = narrowed.data();
    } else {
      dst = const_cast<void*>(p->arrays.grad);  // the DRAM grad tensor, idle between landings
    }
    if (dtype == DType::kF32) {
      std::memcpy(dst, src, bytes);
    } else {
      std::vector<float> scratch(count);
      optim::ParamArrays a;
      a.master = scratch.data();
      a.weight = dst;
      a.weight_dtype = dtype;
      a.count = count;
      kernels_->master_set(a, src, 0, count);
    }
    p->hold = GradHold::kGrad;
    if (p->hbm_grad) {
      Status s = runtime_->backend()->copy_sync(const_cast<unsigned char*>(p->grad_device),
                                                narrowed.data(), bytes);
      if (!s.is_ok()) {
        // Its values are unspecified now: a NaN norm tells clipping and a loss scaler so.
        p->grad_mult = 1.f;
        p->grad_sq = std::numeric_limits<double>::quiet_NaN();
        return error(s.code(), "grad_write: copying the grad into HBM: ", s.message());
      }
    }
    stored.grad = dst;
    stored.grad_dtype = dtype;
  }
  p->grad_mult = 1.f;
  p->grad_sq = kernels_->sum_squares(stored, 0, count);
  return Status::ok();
}

Status Optimizer::grad_zero(TensorId weight, bool keep_zeros) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p, "grad_zero"));
  if (p->in_place && p->hold == GradHold::kGrad &&
      backward_[static_cast<std::size_t>(p->layer)] == Backward::kLoaded) {
    // Its backward load kept the sum for the framework to add to (the load of a param holding
    // none or zeros zero-fills it): zeroed now, through the load's queue.
    Status s = write_sum(*p, nullptr);
    if (!s.is_ok()) {
      mark_unknown(*p);  // still held
      return error(s.code(), "grad_zero: ", s.message());
    }
  }
  p->unknown = false;  // none or zeros: the next backward load zero-fills the home
  p->hold = keep_zeros ? GradHold::kZero : GradHold::kNone;
  p->grad_mult = 1.f;
  p->grad_sq = 0;
  p->measured = true;
  return Status::ok();
}

Status Optimizer::set_param_step(TensorId weight, uint64_t step) {
  std::unique_lock lock(mutex_);
  if (!config_.explicit_updates) {
    return error(Code::kInvalidState,
                 "per-parameter update counts exist in explicit update mode only");
  }
  for (Param& p : params_) {
    if (p.weight != weight) continue;
    // Updates queued with the old count must not be overtaken.
    const auto layer = p.layer;
    cv_.wait(lock, [&] {
      return !failure_.is_ok() || layer < 0 || pending_[static_cast<std::size_t>(layer)] == 0;
    });
    STRATA_RETURN_IF_ERROR(failure_);
    p.t = step;
    return Status::ok();
  }
  return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
}

}  // namespace strata
