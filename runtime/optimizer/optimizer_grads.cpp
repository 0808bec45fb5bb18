// Grads held per parameter, as p.grad in PyTorch (GradHold, docs/architecture.md): reading,
// scaling, writing and zeroing them, the fp32 accumulator, per-parameter update counts.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/optimizer/optimizer_internal.h"

namespace strata {

Status Optimizer::ensure_accum(Param& p) {
  if (p.accum != 0) return Status::ok();
  TensorRecord w;
  STRATA_RETURN_IF_ERROR(runtime_->info(p.weight, &w));
  void* data = nullptr;
  Status s = make_state(w, ".grad_accum", kSkew[3], Tier::kDram, &p.accum, &data);
  p.accum_data = static_cast<float*>(data);
  if (!s.is_ok()) {
    return error(s.code(),
                 "gradient accumulation (a backward pass onto grads not zeroed since the last "
                 "one) needs an fp32 sum per parameter: ",
                 s.message());
  }
  return Status::ok();
}

Status Optimizer::held_grad(TensorId weight, std::unique_lock<std::mutex>& lock, Param** out) {
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
  cv_.wait(lock, [&] { return !failure_.is_ok() || landing_[layer] == 0; });
  STRATA_RETURN_IF_ERROR(failure_);
  *out = param;
  return Status::ok();
}

Status Optimizer::grad_info(TensorId weight, GradInfo* out) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
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
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
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
  optim::ParamArrays a;
  a.grad = p->hold == GradHold::kAccum ? static_cast<const void*>(p->accum_data) : p->arrays.grad;
  std::vector<unsigned char> fetched;  // an HBM-homed grad: copied here (the fetch buffer is
                                       // the dispatcher's)
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
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_scale: the parameter holds no grad");
  }
  p->grad_mult *= factor;
  return Status::ok();
}

Status Optimizer::grad_write(TensorId weight, const float* src, uint64_t count) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
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
  optim::ParamArrays stored;  // what now holds the grad, for its sum of squares
  stored.count = count;
  std::vector<unsigned char> narrowed;  // an HBM-homed grad's values, on their way there
  // Inside an executor step a zeroed grad's tensor is about to receive this step's backward
  // (which would replace what is written there): the accumulator takes it, and the landing adds.
  if (p->hold == GradHold::kAccum || (p->hold == GradHold::kZero && in_executor_step_)) {
    STRATA_RETURN_IF_ERROR(ensure_accum(*p));
    std::memcpy(p->accum_data, src, count * sizeof(float));
    p->hold = GradHold::kAccum;
    stored.grad = p->accum_data;
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
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  p->hold = keep_zeros ? GradHold::kZero : GradHold::kNone;
  p->grad_mult = 1.f;
  p->grad_sq = 0;
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
