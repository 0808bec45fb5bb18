// In-place gradient sums (GradSum::kInPlace, explicit mode): the param's grad tensor, fp32 in
// HBM, is the sum of its backward passes. The framework adds each pass's grad into the view;
// the backward load zero-fills the home only when the param holds no grad (on_backward_load),
// so there is no accumulator and no stash, and a landing copies nothing out of HBM. What the
// optimizer cannot see happen on the device is made safe by refusing it (docs/optimizer.md,
// "Sums in place on the device"):
// - a pending grad_mult is applied to the sum in HBM at the layer's backward load, before the
//   framework adds to it; grad_scale between that load and the landing is refused, since the
//   landing adds to a sum the factor would have to apply to, not to what is added;
// - while the layer is acquired for its backward pass (its adds in flight) the sum is neither
//   read, measured, scaled, written nor zeroed;
// - every write or zero fill of a home inside a step goes through the H2D queue, the one the
//   executor's zero fills use, so a fill queued earlier cannot land after it;
// - the sum of squares is measured when asked (grad_info, grad_read), never at the landing:
//   a landing or an abort only marks it unmeasured, so a stale figure cannot be reported.
#include <cmath>
#include <limits>

#include "runtime/optimizer/optimizer.h"

namespace strata {

Status Optimizer::fetch_sum(const Param& p, std::vector<float>* values) const {
  values->resize(p.arrays.count);
  Status s =
      runtime_->backend()->copy_sync(values->data(), p.grad_device, p.arrays.count * sizeof(float));
  if (!s.is_ok()) {
    return error(s.code(), "reading an in-place gradient sum out of HBM: ", s.message());
  }
  return Status::ok();
}

void Optimizer::measure_sum(Param& p, const float* values) {
  optim::ParamArrays a;
  a.grad = values;
  a.grad_dtype = DType::kF32;
  a.count = p.arrays.count;
  // Task by task in the order a landing's job adds them up (the kernel's blocks start at each
  // task's beginning): the figure an accumulator of the same values would report, bit for bit.
  double total = 0;
  for (const Task& t : layer_tasks_[static_cast<std::size_t>(p.layer)]) {
    if (&params_[t.param] == &p) total += kernels_->sum_squares(a, t.begin, t.end);
  }
  p.grad_sq = total;
  p.measured = true;
}

Status Optimizer::ensure_measured(Param& p) {
  if (!p.in_place || p.hold != GradHold::kGrad || p.measured) return Status::ok();
  std::vector<float> values;
  STRATA_RETURN_IF_ERROR(fetch_sum(p, &values));
  measure_sum(p, values.data());
  return Status::ok();
}

Status Optimizer::write_sum(const Param& p, const float* src) {
  CopyRequest r;
  r.direction = CopyDirection::kHostToDevice;
  r.dst = const_cast<unsigned char*>(p.grad_device);
  r.src = src;  // null: a zero fill
  r.bytes = p.arrays.count * sizeof(float);
  std::shared_ptr<DeviceFence> done;
  Status s = runtime_->backend()->submit_copy(std::move(r), &done);
  if (s.is_ok()) s = done->host_wait();
  if (!s.is_ok()) {
    return error(s.code(), src == nullptr ? "zeroing" : "writing",
                 " an in-place gradient sum in HBM: ", s.message());
  }
  return Status::ok();
}

Status Optimizer::apply_sum_factor(Param& p) {
  std::vector<float> values;
  STRATA_RETURN_IF_ERROR(fetch_sum(p, &values));  // nothing changed yet on failure
  for (float& v : values) v *= p.grad_mult;       // as an accumulator is scaled (run_explicit)
  Status s = write_sum(p, values.data());
  p.grad_mult = 1.f;
  if (!s.is_ok()) {
    // Partly written: its values are unspecified, and a NaN norm tells clipping so.
    p.grad_sq = std::numeric_limits<double>::quiet_NaN();
    p.measured = true;
    return s;
  }
  measure_sum(p, values.data());
  return Status::ok();
}

Status Optimizer::on_backward_load(uint32_t layer, const std::vector<TensorId>& grads,
                                   std::vector<HomeGrad>* modes) {
  std::lock_guard lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  if (in_place_params_ == 0 || layer >= layer_params_.size()) return Status::ok();
  // First the factors pending on held sums, before any state of the layer changes: a copy that
  // fails leaves every param as it was (or, the one whose write-back failed, held with
  // unspecified values), and the load, refused, is asked again whole. Its last reader, the
  // update of the step before, is done: the executor loads a layer only once layer_ready says
  // so, and nothing else queues work on it inside a step.
  for (std::size_t i : layer_params_[layer]) {
    Param& p = params_[i];
    if (p.in_place && p.hold == GradHold::kGrad && p.grad_mult != 1.f) {
      STRATA_RETURN_IF_ERROR(apply_sum_factor(p));
    }
  }
  for (std::size_t k = 0; k < grads.size(); ++k) {
    for (std::size_t i : layer_params_[layer]) {
      Param& p = params_[i];
      if (p.grad != grads[k] || !p.in_place) continue;
      if (p.hold == GradHold::kGrad) {
        (*modes)[k] = HomeGrad::kHeldSum;
      } else {
        (*modes)[k] = HomeGrad::kEmptySum;
        p.grad_mult = 1.f;  // a factor on zeros is nothing
      }
    }
  }
  backward_[layer] = Backward::kLoaded;
  return Status::ok();
}

void Optimizer::on_backward_acquired(uint32_t layer) {
  std::lock_guard lock(mutex_);
  if (layer < backward_.size()) backward_[layer] = Backward::kAcquired;
}

}  // namespace strata
