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
//   a landing or an abort only marks it unmeasured, so a stale figure cannot be reported. The
//   first call that finds one unmeasured queues a kMeasure job for every layer holding one
//   (queue_measurements): the dispatcher copies the sums through the pinned fetch buffer and
//   reduces them on the pool, as a landing's job does, while the caller waits for its layer's.
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

void Optimizer::queue_measurements(const Param* reader, std::shared_ptr<SumRead> read) {
  // Every unmeasured sum at once, one job per layer: clipping asks for every param's figure in
  // turn, and the dispatcher then fetches and reduces them on the pool, layer after layer,
  // while the caller waits only for the layer it asked about.
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    const bool reads = reader != nullptr && static_cast<std::size_t>(reader->layer) == l;
    if (!reads && backward_[l] == Backward::kAcquired) continue;  // its adds are in flight
    Job job;
    job.kind = JobKind::kMeasure;
    job.layer = static_cast<int>(l);
    bool any = reads;
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      const bool measure = p.in_place && p.hold == GradHold::kGrad && !p.measured && !p.measuring;
      if (measure) {
        p.measuring = true;
        p.measure_error = Status::ok();
      }
      job.add.push_back(measure ? 1 : 0);
      any = any || measure;
    }
    if (!any) continue;
    if (reads) job.read = read;
    // An abort's adds still running: the job's fetch starts after them.
    if (aborted_adds_[l]) job.landed.push_back(aborted_adds_[l]);
    job.sums.assign(layer_params_[l].size(), 0.0);
    ++landing_[l];
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void Optimizer::mark_unknown(Param& p) {
  p.unknown = true;
  p.grad_mult = 1.f;
  p.grad_sq = std::numeric_limits<double>::quiet_NaN();
  p.measured = true;
}

Status Optimizer::wait_aborted_adds(std::size_t layer, std::unique_lock<std::mutex>& lock) {
  while (layer < aborted_adds_.size() && aborted_adds_[layer]) {
    const std::shared_ptr<DeviceFence> adds = aborted_adds_[layer];
    lock.unlock();
    Status s = adds->host_wait();  // the framework's stream, which waits on nothing of ours
    lock.lock();
    if (aborted_adds_[layer] == adds) aborted_adds_[layer].reset();
    if (!s.is_ok()) {
      return error(s.code(), "waiting for the adds into layer ", layer,
                   "'s in-place gradient sums that its abort left running: ", s.message());
    }
  }
  return Status::ok();
}

Status Optimizer::ensure_measured(Param& p, std::unique_lock<std::mutex>& lock) {
  const auto layer = static_cast<std::size_t>(p.layer);
  // Again while another thread's step made it change meanwhile (its layer landed once more).
  while (p.in_place && p.hold == GradHold::kGrad && !p.measured) {
    if (!p.measuring) queue_measurements(nullptr, nullptr);
    cv_.wait(lock, [&] { return !failure_.is_ok() || landing_[layer] == 0; });
    STRATA_RETURN_IF_ERROR(failure_);
    if (!p.measured && !p.measure_error.is_ok()) {
      return error(p.measure_error.code(),
                   "measuring an in-place gradient sum: ", p.measure_error.message());
    }
  }
  return Status::ok();
}

Status Optimizer::read_sum(Param& p, float* dst, std::unique_lock<std::mutex>& lock) {
  auto read = std::make_shared<SumRead>();
  read->dst = dst;
  read->slot = p.in_layer;
  read->mult = p.grad_mult;  // nothing changes it before the job is done (landing_)
  queue_measurements(&p, read);
  // Until the job is done or dropped, whatever else fails: it writes into the caller's buffer.
  cv_.wait(lock, [&] { return read->done; });
  if (!read->status.is_ok()) {
    return error(read->status.code(),
                 "reading an in-place gradient sum out of HBM: ", read->status.message());
  }
  return Status::ok();
}

void Optimizer::finish_measure(const Job& job, const Status& status) {
  const auto l = static_cast<std::size_t>(job.layer);
  for (std::size_t k = 0; k < job.add.size(); ++k) {
    if (job.add[k] == 0) continue;
    Param& p = params_[layer_params_[l][k]];
    p.measuring = false;
    if (!status.is_ok()) {
      p.measure_error = status;
      continue;
    }
    // Per task in the order a landing's job sums them (run_explicit): the accumulator's figure.
    p.grad_sq = job.sums[k];
    p.measured = true;
  }
  if (job.read) {
    job.read->status = status;
    job.read->done = true;
  }
  --landing_[l];
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
    // Partly written (or, refused whole, unscaled): unspecified, and a NaN norm tells clipping
    // so, until the framework zeroes or writes it (the adds of later passes do not tell).
    mark_unknown(p);
    return s;
  }
  measure_sum(p, values.data());
  return Status::ok();
}

Status Optimizer::on_backward_load(uint32_t layer, const std::vector<TensorId>& grads,
                                   std::vector<HomeGrad>* modes) {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  if (in_place_params_ == 0 || layer >= layer_params_.size()) return Status::ok();
  // An abort's adds (its finish_step waited for them before a next step could begin: done).
  STRATA_RETURN_IF_ERROR(wait_aborted_adds(layer, lock));
  // A measurement queued since layer_ready said yes reads the sums first (a zero fill or a
  // factor written under its fetch would tear what it reads).
  cv_.wait(lock, [&] { return !failure_.is_ok() || landing_[layer] == 0; });
  if (!failure_.is_ok()) return failure_;
  // First the factors pending on held sums, before any state of the layer changes: a copy that
  // fails leaves every param as it was (or, the one whose write-back failed, held with
  // unspecified values), and the load, refused, is asked again whole. Its last reader, the
  // update of the step before, is done: the executor loads a layer only once layer_ready says
  // so, and nothing else queues work on it inside a step.
  for (std::size_t i : layer_params_[layer]) {
    Param& p = params_[i];
    if (p.in_place && p.hold == GradHold::kGrad && p.grad_mult != 1.f) {
      if (p.unknown) {
        p.grad_mult = 1.f;  // a factor on unspecified values is nothing
        continue;
      }
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
  std::unique_lock lock(mutex_);
  if (layer >= backward_.size()) return;
  // A measurement of a sum queued between the load and now (grad_info, grad_read) ends before
  // the framework may add to it. (A failed optimizer's dropped jobs no longer count.)
  cv_.wait(lock, [&] { return !failure_.is_ok() || landing_[layer] == 0; });
  backward_[layer] = Backward::kAcquired;
}

}  // namespace strata
