// Running the work of a job on the thread pool: each kind's scalars (AdamW, Adam, SGD, Lion,
// Adagrad), automatic updates and norms, explicit steps (strata_optimizer_step).
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/clock.h"

namespace strata {

namespace {
// One update's scalars for a group at update count t (the grad multiplied by grad_scale). The
// betas are the group's at this update, bias corrections included, as torch's AdamW computes
// 1 - beta1 ** step from the param group's current betas at every step. Bias corrections and
// products of hyperparameters in double, as PyTorch computes them in Python floats.
optim::UpdateScalars update_scalars(const OptimizerConfig& c, const GroupHyperparams& g, uint64_t t,
                                    float grad_scale) {
  optim::UpdateScalars u;
  const double lr = g.lr, wd = g.weight_decay;
  switch (c.kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: {
      optim::AdamWScalars& a = u.adamw;
      a.grad_scale = grad_scale;
      a.beta1 = g.beta1;
      a.beta2 = g.beta2;
      a.eps = g.eps;
      // AdamW decays the weight apart from the grad, Adam adds the decay to the grad (L2).
      const bool decoupled = c.kind == OptimizerKind::kAdamW;
      a.lr_decay = decoupled ? static_cast<float>(lr * wd) : 0.f;
      a.l2 = decoupled ? 0.f : g.weight_decay;
      const double td = static_cast<double>(t);
      a.step_size = static_cast<float>(lr / (1.0 - std::pow(double{g.beta1}, td)));
      a.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{g.beta2}, td)));
      break;
    }
    case OptimizerKind::kSgd: {
      optim::SgdScalars& q = u.sgd;
      q.grad_scale = grad_scale;
      q.lr = g.lr;
      q.weight_decay = g.weight_decay;
      q.momentum = c.momentum;
      q.dampening = c.dampening;
      q.nesterov = c.nesterov;
      q.first_step = t == 1;
      break;
    }
    case OptimizerKind::kLion: {
      optim::LionScalars& l = u.lion;
      l.grad_scale = grad_scale;
      l.lr = g.lr;
      l.beta1 = g.beta1;
      l.beta2 = g.beta2;
      l.keep = static_cast<float>(1.0 - lr * wd);
      break;
    }
    case OptimizerKind::kAdagrad: {
      // torch's lr_decay (lr / (1 + (t - 1) lr_decay)) is the framework's: it sets the
      // group's lr (strata.torch.Adagrad does).
      optim::AdagradScalars& a = u.adagrad;
      a.grad_scale = grad_scale;
      a.lr = g.lr;
      a.weight_decay = g.weight_decay;
      a.eps = g.eps;
      break;
    }
  }
  return u;
}

// The kind's kernel over elements [begin, end) of `a`.
void run_update(const optim::KernelTable& k, OptimizerKind kind, const optim::UpdateScalars& u,
                const optim::ParamArrays& a, std::size_t begin, std::size_t end) {
  switch (kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return k.adamw(u.adamw, a, begin, end);
    case OptimizerKind::kSgd:
      return k.sgd(u.sgd, a, begin, end);
    case OptimizerKind::kLion:
      return k.lion(u.lion, a, begin, end);
    case OptimizerKind::kAdagrad:
      return k.adagrad(u.adagrad, a, begin, end);
  }
}

// Elements [begin, end) of `a` as arrays of their own, starting at element 0.
optim::ParamArrays subarray(const optim::ParamArrays& a, std::size_t begin, std::size_t end) {
  auto at = [begin](auto* p, DType d) {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(p)>>,
                                    const unsigned char, unsigned char>;
    return p == nullptr
               ? p
               : reinterpret_cast<decltype(p)>(reinterpret_cast<Byte*>(p) + begin * dtype_size(d));
  };
  optim::ParamArrays s = a;
  s.master = at(a.master, DType::kF32);
  s.exp_avg = at(a.exp_avg, DType::kF32);
  s.exp_avg_sq = at(a.exp_avg_sq, DType::kF32);
  s.grad = at(a.grad, a.grad_dtype);
  s.grad_accum = at(a.grad_accum, DType::kF32);
  s.weight = at(a.weight, a.weight_dtype);
  s.master_low = at(a.master_low, DType::kI16);
  s.count = end - begin;
  return s;
}
}  // namespace

double Optimizer::run_tasks(std::span<const Task> tasks, JobKind kind, const StepScalars* s,
                            bool first, Arrivals* arrivals, std::size_t offset) {
  std::vector<double> sums(kind == JobKind::kNorm ? tasks.size() : 0);
  std::vector<optim::UpdateScalars> groups;
  if (kind == JobKind::kUpdate) {
    for (const GroupHyperparams& g : s->groups) {
      groups.push_back(update_scalars(config_, g, s->t, s->grad_scale));
    }
  }
  pool_->run(tasks.size(), [&](std::size_t k) {
    // A grad that did not arrive: the task runs nothing (the job fails with it).
    if (arrivals != nullptr && !arrivals->wait(offset + k)) return;
    const Task& task = tasks[k];
    const Param& p = params_[task.param];
    switch (kind) {
      case JobKind::kAccumulate:
        kernels_->accumulate(p.arrays, task.begin, task.end, first);
        break;
      case JobKind::kNorm:
        sums[k] = kernels_->sum_squares(p.arrays, task.begin, task.end);
        break;
      case JobKind::kUpdate: {
        run_update(*kernels_, config_.kind, groups[p.group], update_arrays(p), task.begin,
                   task.end);
        break;
      }
      case JobKind::kLand:
      case JobKind::kStash:
      case JobKind::kMeasure:
        break;  // explicit mode: run_explicit
    }
  });
  double total = 0;
  for (double v : sums) total += v;
  return total;
}

void Optimizer::run_explicit(std::span<const Task> tasks, Job& job, Arrivals* arrivals,
                             std::size_t offset) {
  std::vector<double> sums(tasks.size(), 0.0);
  pool_->run(tasks.size(), [&](std::size_t k) {
    // A grad that did not arrive: the task runs nothing (the job fails with it).
    if (arrivals != nullptr && !arrivals->wait(offset + k)) return;
    const Task& task = tasks[k];
    const Param& p = params_[task.param];
    const std::size_t b = task.begin, e = task.end;
    const std::size_t slot = p.in_layer;
    // Views built from the fields fixed at add_param, plus the accumulator where the job
    // uses it (it was allocated before the job was queued).
    optim::ParamArrays grad_view;  // the landed grad
    grad_view.grad = p.arrays.grad;
    grad_view.grad_dtype = p.arrays.grad_dtype;
    grad_view.count = p.arrays.count;
    optim::ParamArrays accum_view;  // the accumulator read as a grad
    accum_view.grad_dtype = DType::kF32;
    accum_view.count = p.arrays.count;
    // The accumulator (in DRAM, or staged in the layer's slot) is read only by a job that
    // uses it: only such a job waited for the slot (stage_need), and the NVMe tier's thread
    // may release the slot of another use meanwhile, writing p.staged (TSan: a landing that
    // adds nothing read the pointer it does not use while the slot was released).
    auto scale = [&](float* accum, float m) {
      if (m == 1.f) return;
      for (std::size_t i = b; i < e; ++i) accum[i] *= m;
    };
    switch (job.kind) {
      case JobKind::kLand:
        if (p.in_place) break;  // nothing to take: the sum is in HBM, measured when asked
        if (job.add[slot] != 0) {
          float* const accum = accum_ptr(p);
          accum_view.grad = accum;
          grad_view.grad_accum = accum;
          scale(accum, job.mult[slot]);
          kernels_->accumulate(grad_view, b, e, false);
          sums[k] = kernels_->sum_squares(accum_view, b, e);
        } else {
          sums[k] = kernels_->sum_squares(grad_view, b, e);
        }
        break;
      case JobKind::kStash:
        if (job.add[slot] != 0) {
          float* const accum = accum_ptr(p);
          accum_view.grad = accum;
          grad_view.grad_accum = accum;
          kernels_->accumulate(grad_view, b, e, true);
          scale(accum, job.mult[slot]);
          sums[k] = kernels_->sum_squares(accum_view, b, e);
        }
        break;
      case JobKind::kUpdate: {
        const UpdateSource& src = job.sources[slot];
        if (src.skip) break;
        optim::ParamArrays a = subarray(update_arrays(p), b, e);
        a.grad_accum = nullptr;
        thread_local std::vector<float> zeros;
        const void* grad = src.staged_accum ? static_cast<const void*>(accum_ptr(p)) : src.grad;
        if (grad == nullptr) {
          if (zeros.size() < e - b) zeros.assign(e - b, 0.f);
          a.grad = zeros.data();
          a.grad_dtype = DType::kF32;
        } else {
          a.grad = static_cast<const unsigned char*>(grad) + b * dtype_size(src.dtype);
          a.grad_dtype = src.dtype;
        }
        run_update(*kernels_, config_.kind, src.scalars, a, 0, e - b);
        break;
      }
      case JobKind::kMeasure:
        // As a landing measures a grad it takes (kLand above): per task, summed in task order.
        if (job.add[slot] != 0) sums[k] = kernels_->sum_squares(grad_view, b, e);
        if (job.read && slot == job.read->slot) {
          const auto* sum = static_cast<const float*>(p.arrays.grad);
          float* const dst = job.read->dst;
          const float m = job.read->mult;
          if (m == 1.f) {
            std::memcpy(dst + b, sum + b, (e - b) * sizeof(float));
          } else {
            for (std::size_t i = b; i < e; ++i) dst[i] = sum[i] * m;
          }
        }
        break;
      default:
        break;
    }
  });
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    job.sums.resize(std::max(job.sums.size(), params_[tasks[k].param].in_layer + 1), 0.0);
    job.sums[params_[tasks[k].param].in_layer] += sums[k];
  }
}

Status Optimizer::step_explicit() {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  if (in_executor_step_) {
    return error(Code::kInvalidState,
                 "step inside an executor step: call it after strata_step_end (the backward "
                 "pass's grads are not all in yet)");
  }
  ++counters_.step;
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    if (layer_params_[l].empty()) continue;
    Job job;
    job.kind = JobKind::kUpdate;
    job.layer = static_cast<int>(l);
    bool any = false;
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      UpdateSource src;
      if (p.hold != GradHold::kNone) {
        src.skip = false;
        ++p.t;
        if (p.hold == GradHold::kGrad) {
          src.grad = p.arrays.grad;
          src.dtype = p.arrays.grad_dtype;
        } else if (p.hold == GradHold::kAccum) {
          src.grad = p.accum_data;  // null on NVMe: the job finds it in the layer's slot
          src.staged_accum = p.nvme_accum;
          src.dtype = DType::kF32;
        }
        const float grad_scale = p.grad_mult / counters_.loss_scale;
        const GroupHyperparams& g = groups_[p.group];
        src.scalars = update_scalars(config_, g, p.t, grad_scale);
        any = true;
      }
      job.sources.push_back(src);
    }
    if (!any) continue;
    ++pending_[l];
    queue_.push_back(std::move(job));
  }
  lock.unlock();
  cv_.notify_all();
  return Status::ok();
}

Status Optimizer::step() {
  // One manual step at a time (the header promises it; the pool runs one job at a time). No
  // dispatcher job runs while unattached, and add_param takes step_mutex_ too, so the pool is
  // this step's alone.
  std::lock_guard serial(step_mutex_);
  std::unique_lock lock(mutex_);
  if (executor_ != nullptr && config_.explicit_updates) {
    lock.unlock();
    return step_explicit();
  }
  if (executor_ != nullptr) {
    return error(Code::kInvalidState,
                 "step: the optimizer is attached to an executor, whose steps run its updates");
  }
  if (!failure_.is_ok()) return failure_;
  if (params_.empty()) return error(Code::kInvalidState, "step: the optimizer has no params");
  if (nvme_state_params_ != 0 || nvme_weight_params_ != 0) {
    return error(Code::kInvalidState, "step: ", std::max(nvme_state_params_, nvme_weight_params_),
                 " params have their ", nvme_state_params_ != 0 ? "state" : "weights",
                 " on NVMe, which is staged through DRAM layer by layer: only an optimizer "
                 "attached to an executor updates them");
  }
  if (hbm_grad_params_ != 0) {
    return error(Code::kInvalidState, "step: ", hbm_grad_params_,
                 " params have their grads in HBM, which are fetched into DRAM layer by layer: "
                 "only an optimizer attached to an executor updates them");
  }
  if (all_tasks_params_ != params_.size()) {
    std::vector<std::size_t> all(params_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    all_tasks_ = tasks_for(all);
    all_tasks_params_ = params_.size();
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (micro_ + 1 < config_.accumulation_steps) {
    const bool first = micro_ == 0;
    ++micro_;
    lock.unlock();
    run_tasks(all_tasks_, JobKind::kAccumulate, nullptr, first);
    lock.lock();
    update_seconds_ += seconds_since(t0);
    return Status::ok();
  }
  micro_ = 0;
  StepScalars s;
  s.t = counters_.step + 1;
  s.grad_scale = 1.f / counters_.loss_scale;
  s.groups = groups_;
  if (deferred()) {
    lock.unlock();
    const double total = run_tasks(all_tasks_, JobKind::kNorm, nullptr, false);
    lock.lock();
    finish_norms(total, &s);
  } else {
    counters_.step = s.t;
  }
  if (!s.skip) {
    lock.unlock();
    run_tasks(all_tasks_, JobKind::kUpdate, &s, false);
    lock.lock();
  }
  update_seconds_ += seconds_since(t0);
  return Status::ok();
}

}  // namespace strata
