// Grads held per parameter, as p.grad in PyTorch (GradHold, docs/architecture.md): reading,
// scaling and zeroing them, the fp32 accumulator, per-parameter update counts.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
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
