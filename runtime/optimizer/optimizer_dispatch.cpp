// The scheduler: the executor's hooks queue per-layer jobs, and one dispatcher thread runs the
// lowest ready layer first, preempting a longer job between slices.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <chrono>

#include "common/clock.h"

namespace strata {

void Optimizer::wait_for_norms(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] {
    return !failure_.is_ok() || !current_ || !deferred() ||
           current_->norms_in >= layers_with_params_ || grads_in_ < layers_with_params_;
  });
}

Status Optimizer::on_step_begin() {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  // A deferred step settles t and the loss scale when its last norm is in: wait for that (a
  // few milliseconds after the previous step's last grads landed, and before this step's first
  // load could start anyway, since that waits for its layer's update), so this step's values
  // and what the framework reads from the stats are settled.
  wait_for_norms(lock);
  if (!failure_.is_ok()) return failure_;
  in_executor_step_ = true;
  if (config_.explicit_updates) {
    std::fill(backward_.begin(), backward_.end(), Backward::kIdle);
    // Grads held in the grad tensors would be overwritten by this step's: move them to the
    // fp32 accumulators first (the layer's load, and so its backward, waits for that). An
    // in-place sum stays where it is: this step's backward adds to it.
    for (std::size_t l = 0; l < layer_params_.size(); ++l) {
      Job job;
      job.kind = JobKind::kStash;
      job.layer = static_cast<int>(l);
      bool any = false;
      for (std::size_t i : layer_params_[l]) {
        Param& p = params_[i];
        const bool move = p.hold == GradHold::kGrad && !p.in_place;
        if (move) {
          // The first accumulation places every accumulator (plan_accumulators) before this
          // step's first stash is queued: laying the slots out again waits only for the
          // previous steps' work.
          Status s = ensure_accum(p, lock);
          if (!s.is_ok()) {
            in_executor_step_ = false;
            return s;
          }
          p.hold = GradHold::kAccum;
        }
        job.add.push_back(move ? 1 : 0);
        job.mult.push_back(p.grad_mult);
        if (move) p.grad_mult = 1.f;
        any = any || move;
      }
      if (!any) continue;
      job.sums.assign(layer_params_[l].size(), 0.0);
      ++pending_[l];
      ++landing_[l];
      queue_.push_back(std::move(job));
    }
    // The updates step() will queue run in forward order.
    const std::vector<StageIo> reads = read_ahead(false);
    lock.unlock();
    cv_.notify_all();
    start_io(reads);
    return Status::ok();
  }
  final_micro_ = micro_ + 1 >= config_.accumulation_steps;
  grads_in_ = 0;
  std::vector<StageIo> reads;
  if (final_micro_) {
    auto s = std::make_shared<StepScalars>();
    s->t = counters_.step + 1;
    s->grad_scale = 1.f / counters_.loss_scale;
    s->groups = groups_;
    current_ = std::move(s);
    // Updates follow the grads (backward order) or, deferred, run in forward order.
    reads = read_ahead(!deferred());
  }
  lock.unlock();
  start_io(reads);
  return Status::ok();
}

Status Optimizer::on_grads_queued(uint32_t layer,
                                  std::vector<std::shared_ptr<DeviceFence>> landed) {
  {
    std::lock_guard lock(mutex_);
    if (!failure_.is_ok()) return failure_;
    if (layer >= layer_params_.size() || layer_params_[layer].empty()) return Status::ok();
    Job job;
    job.layer = static_cast<int>(layer);
    job.landed = std::move(landed);
    job.scalars = current_;
    if (config_.explicit_updates) {
      job.kind = JobKind::kLand;
      backward_[layer] = Backward::kIdle;
      for (std::size_t i : layer_params_[layer]) {
        Param& p = params_[i];
        if (p.in_place) {
          // The framework added this pass's grads to the sum in HBM: held, measured when asked
          // (the job only waits for the release's fence). Its factor was applied at the
          // backward load and grad_scale refused since, so grad_mult is 1 and nothing is lost.
          p.hold = GradHold::kGrad;
          p.measured = p.unknown;  // unknown values plus adds: still unknown (NaN)
          job.add.push_back(0);
          job.mult.push_back(1.f);
          continue;
        }
        if (p.hold == GradHold::kGrad) {
          return error(Code::kInvalidState, "optimizer: layer ", layer,
                       "'s grads landed twice without a step_begin between");
        }
        const bool add = p.hold == GradHold::kAccum;
        job.add.push_back(add ? 1 : 0);
        job.mult.push_back(p.grad_mult);
        if (!add) p.hold = GradHold::kGrad;
        p.grad_mult = 1.f;
      }
      job.sums.assign(layer_params_[layer].size(), 0.0);
      ++pending_[layer];
      ++landing_[layer];
      queue_.push_back(std::move(job));
      cv_.notify_all();
      return Status::ok();
    }
    if (!final_micro_) {
      job.kind = JobKind::kAccumulate;
      job.first_micro = micro_ == 0;
    } else {
      // Deferred: the norm now, the update (counted as pending from now) after the last norm.
      job.kind = deferred() ? JobKind::kNorm : JobKind::kUpdate;
    }
    ++pending_[layer];
    queue_.push_back(std::move(job));
    if (++grads_in_ == layers_with_params_) {
      // The step's last grads are queued: the next executor step is the next micro-step.
      if (final_micro_) {
        micro_ = 0;
        if (!deferred()) counters_.step = current_->t;
      } else {
        ++micro_;
      }
    }
  }
  cv_.notify_all();
  return Status::ok();
}

void Optimizer::on_step_end() {
  std::lock_guard lock(mutex_);
  in_executor_step_ = false;
}

void Optimizer::on_step_aborted(std::shared_ptr<DeviceFence> adds_done) {
  {
    std::lock_guard lock(mutex_);
    in_executor_step_ = false;
    // A layer abandoned while acquired for its backward pass: the framework's adds into its
    // in-place sums stay there, so a held sum's figure is stale; a sum holding none or zeros
    // is zero-filled again by its next backward load. The adds may still run (the abort waits
    // for its stream after this call): until adds_done, nothing reads or writes those sums.
    for (std::size_t l = 0; l < backward_.size(); ++l) {
      if (backward_[l] != Backward::kAcquired) continue;
      for (std::size_t i : layer_params_[l]) {
        if (params_[i].in_place) params_[i].measured = params_[i].unknown;
      }
      if (adds_done) aborted_adds_[l] = adds_done;
    }
    std::fill(backward_.begin(), backward_.end(), Backward::kIdle);
    if (!config_.explicit_updates && grads_in_ > 0 && grads_in_ < layers_with_params_) {
      // Part of an automatic step's grads came: what they started (accumulation, updates,
      // norms) runs to its end, and the next step starts afresh. A deferred step's norms
      // never complete: its norm jobs release their layers themselves.
      if (current_ && deferred() && final_micro_) {
        current_->aborted = true;
        for (int l : current_->normed) --pending_[static_cast<std::size_t>(l)];
        current_->normed.clear();
      }
      micro_ = 0;
    }
    grads_in_ = 0;
  }
  cv_.notify_all();
}

bool Optimizer::layer_ready(uint32_t layer) {
  std::lock_guard lock(mutex_);
  return failure_.is_ok() && (layer >= pending_.size() || pending_[layer] == 0);
}

Status Optimizer::wait_layer(uint32_t layer) {
  std::unique_lock lock(mutex_);
  cv_.wait(lock,
           [&] { return !failure_.is_ok() || layer >= pending_.size() || pending_[layer] == 0; });
  return failure_;
}

Status Optimizer::synchronize() {
  std::unique_lock lock(mutex_);
  return drain(lock);
}

Status Optimizer::drain(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] {
    // A job in progress (its pool tasks, its grads' copies into the fetch buffer) or a staging
    // transfer may still write state, failed or not: a checkpoint load or a re-attach after a
    // failure must not start under it. Queued jobs are not waited for once failed: their
    // grads may never land.
    if (running_ > 0 || io_in_flight_ > 0) return false;
    if (!failure_.is_ok()) return true;
    if (!queue_.empty()) return false;
    return std::all_of(pending_.begin(), pending_.end(), [](int p) { return p == 0; });
  });
  if (failure_.is_ok()) {
    // State read ahead is dropped: after synchronize the NVMe copy is the only one, so the
    // caller may read or write it (the next executor step reads ahead again).
    ahead_round_ = 0;
    for (std::size_t l = 0; l < stages_.size(); ++l) {
      if (stages_[l].phase == StagePhase::kStaged) release_slot(l);
    }
  }
  return failure_;
}

uint64_t Optimizer::job_bytes(std::span<const Task> tasks, JobKind kind) const {
  uint64_t bytes = 0;
  for (const Task& t : tasks) {
    const optim::ParamArrays& a = params_[t.param].arrays;
    const bool split = params_[t.param].split;  // a.master_low is null while staged from NVMe
    const uint64_t n = t.end - t.begin;
    uint64_t per = dtype_size(a.grad_dtype) + (a.grad_accum != nullptr ? 4 : 0);
    if (kind == JobKind::kAccumulate) per = dtype_size(a.grad_dtype) + 8;
    if (kind == JobKind::kUpdate) {
      // The master read and written (a split one: its low halves and the weight read too).
      per += split ? 4 + dtype_size(a.weight_dtype) : 8;
      if (a.exp_avg != nullptr) per += 8;
      if (a.exp_avg_sq != nullptr) per += 8;
      if (a.weight != nullptr) per += dtype_size(a.weight_dtype);
    }
    bytes += n * per;
  }
  return bytes;
}

bool Optimizer::slot_starved() const {
  return std::any_of(queue_.begin(), queue_.end(), [&](const Job& j) {
    return needs_stage(j) && stages_[static_cast<std::size_t>(j.layer)].phase == StagePhase::kIdle;
  });
}

bool Optimizer::runs_before(const Job& a, const Job& b, bool starved) const {
  // While an update waits for a staging slot, updates that hold one (their state is staged or
  // being read) go first: the slots and the disk are then the critical path, each update done
  // frees a slot for the next read, and the DRAM layers' updates, which need neither, fill the
  // time the reads take (9B with state on NVMe, H100: 13.7 -> 12.2 s per step). Otherwise, and
  // among equals, the lower layer.
  if (starved) {
    const auto holds = [&](const Job& j) {
      return needs_stage(j) &&
             stages_[static_cast<std::size_t>(j.layer)].phase != StagePhase::kIdle;
    };
    const bool a_holds = holds(a);
    if (a_holds != holds(b)) return a_holds;
  }
  return a.layer < b.layer;
}

std::size_t Optimizer::pick_job() const {
  // Earliest deadline first: the next step's forward pass loads layer 0 first, so among the
  // jobs whose grads have landed the lowest layer goes first. During the backward pass that is
  // the layer that just landed, so a backlog the pass could not absorb is left in the highest
  // layers, which the next forward pass needs last; first-come order would leave it in layer
  // 0, which the next step needs first (on the H200, a step whose updates outlasted its
  // backward pass grew 15% with first-come order). runs_before has the one exception (slots).
  // A layer's jobs run in the order they were queued (a grad lands, is stashed, updates), so
  // only the first queued job of each layer is a candidate.
  const bool starved = slot_starved();
  std::size_t best = queue_.size();
  std::vector<int> seen;
  for (std::size_t i = 0; i < queue_.size(); ++i) {
    const Job& j = queue_[i];
    if (std::find(seen.begin(), seen.end(), j.layer) != seen.end()) continue;
    seen.push_back(j.layer);
    if (best < queue_.size() && !runs_before(j, queue_[best], starved)) continue;
    const bool landed =
        std::all_of(j.landed.begin(), j.landed.end(), [](const auto& f) { return f->is_done(); });
    if (landed && stage_ready(j)) best = i;
  }
  return best;
}

void Optimizer::dispatcher_main() {
  for (;;) {
    Job job;
    bool picked = false;
    Status failed_at_pick;
    std::vector<std::shared_ptr<DeviceFence>> oldest;
    std::vector<StageIo> reads;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to finish
      reads = stage_more();
      const std::size_t pick = pick_job();
      if (pick == queue_.size()) {
        // Nothing ready: wait for the first grads still landing, else (every landed job waits
        // for its state from NVMe) for a staging transfer to finish.
        for (const Job& j : queue_) {
          const bool landed = std::all_of(j.landed.begin(), j.landed.end(),
                                          [](const auto& f) { return f->is_done(); });
          if (!landed) {
            oldest = j.landed;
            break;
          }
        }
        if (oldest.empty() && reads.empty()) {
          // Every landed job waits for its state: a staging transfer's end notifies. (With
          // none in flight, a fence landed since pick_job looked: pick again.)
          if (io_in_flight_ > 0) {
            const auto t0 = std::chrono::steady_clock::now();
            cv_.wait(lock);
            stage_wait_seconds_ += seconds_since(t0);
          }
          continue;
        }
      } else {
        job = std::move(queue_[pick]);
        queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(pick));
        ++running_;
        picked = true;
        // Failed: nothing more is computed (a load is the only writer from here on, and a
        // synchronize that returned must stay true); the job only does its bookkeeping.
        failed_at_pick = failure_;
        // Its slot, if read ahead, is now in use: no longer one take_slot may take back, nor
        // one stage_more may read more into.
        if (needs_stage(job)) {
          stages_[static_cast<std::size_t>(job.layer)].ahead = false;
          stages_[static_cast<std::size_t>(job.layer)].in_use = true;
        }
      }
    }
    start_io(reads);
    if (!oldest.empty()) {
      for (const auto& f : oldest) (void)f->host_wait();  // errors: reported when it runs
      continue;
    }
    if (!picked) continue;
    Status status = failed_at_pick;
    for (const auto& f : job.landed) {
      Status s = f->host_wait();
      if (status.is_ok() && !s.is_ok()) status = s;
    }
    const bool staged = needs_stage(job);
    Status stage_status;
    if (staged) {
      std::lock_guard lock(mutex_);
      const LayerStage& st = stages_[static_cast<std::size_t>(job.layer)];
      stage_status = st.phase == StagePhase::kStaged ? st.status : failure_;
    }
    const std::vector<Task>& tasks = layer_tasks_[static_cast<std::size_t>(job.layer)];
    double norm = 0;
    double seconds = 0;
    bool preempted = false;
    const bool skip = job.kind == JobKind::kUpdate && job.scalars && job.scalars->skip;
    // Updates and accumulation run in slices of about one task per thread; between slices a
    // lower layer whose grads have landed takes over (the rest of this job goes back to the
    // queue). Without that, layer 0's update, which lands last and is needed first, waited for
    // whatever higher layer the pool had just started. Norms are short and run whole.
    const bool whole = job.kind == JobKind::kNorm || job.kind == JobKind::kMeasure;
    const std::size_t slice = whole ? tasks.size() : pool_->size();
    const bool explicit_job = !job.sources.empty() || job.kind == JobKind::kLand ||
                              job.kind == JobKind::kStash || job.kind == JobKind::kMeasure;
    // HBM-homed grads: every remaining task's copy starts now, each task waits for its own.
    Arrivals arrivals;
    const std::size_t first_task = job.next_task;
    if (status.is_ok() && stage_status.is_ok() && !skip && job.next_task < tasks.size()) {
      status = fetch_grads(std::span<const Task>(tasks).subspan(first_task), job, &arrivals);
    }
    while (status.is_ok() && stage_status.is_ok() && !skip && job.next_task < tasks.size()) {
      const std::size_t n = std::min(slice, tasks.size() - job.next_task);
      const std::span<const Task> part(tasks.data() + job.next_task, n);
      const std::size_t offset = job.next_task - first_task;
      TraceSpan trace(runtime_->tracer(), TraceKind::kOptimizer);
      const auto t0 = std::chrono::steady_clock::now();
      if (explicit_job) {
        run_explicit(part, job, &arrivals, offset);
      } else {
        norm += run_tasks(part, job.kind, job.scalars.get(), job.first_micro, &arrivals, offset);
      }
      {
        std::lock_guard lock(arrivals.mutex);
        if (!arrivals.failed.is_ok()) status = fetch_failed(job.layer, arrivals.failed);
      }
      seconds += seconds_since(t0);
      if (trace.tracing())
        trace.end(job_bytes(part, job.kind), job.layer, static_cast<int32_t>(job.kind));
      job.next_task += n;
      if (!status.is_ok()) break;
      if (job.next_task < tasks.size() && !whole) {
        std::lock_guard lock(mutex_);
        const std::size_t pick = pick_job();
        // A job that runs before this one (by pick_job's order) takes over.
        if (pick < queue_.size() && runs_before(queue_[pick], job, slot_starved())) {
          preempted = true;
          break;
        }
      }
    }
    if (preempted) {
      // Its grads still arriving land before the next job's take the buffer (it fetches its
      // remaining slices again when it resumes), and before it stops counting as running (a
      // failed optimizer's drain returns once nothing runs).
      (void)arrivals.drain();
      {
        std::lock_guard lock(mutex_);
        update_seconds_ += seconds;
        --running_;
        if (staged) stages_[static_cast<std::size_t>(job.layer)].in_use = false;
        // At the front: it stays ahead of any later job of its layer (pick_job keeps each
        // layer's jobs in queue order).
        queue_.push_front(std::move(job));
      }
      cv_.notify_all();  // drain waits for running_ to reach 0
      continue;
    }
    {
      Status fetched = arrivals.drain();
      if (status.is_ok() && !fetched.is_ok()) status = fetch_failed(job.layer, fetched);
    }
    std::vector<StageIo> writes;
    {
      std::lock_guard lock(mutex_);
      update_seconds_ += seconds;
      --running_;
      bool wrote = false;  // this job started its layer's write-back
      if (staged) {
        // What the job changed: an update the state and weights (unless skipped), a landing
        // or a stash the accumulators.
        const bool ran = status.is_ok() && stage_status.is_ok() && !skip;
        const uint8_t dirty = !ran ? 0 : job.kind == JobKind::kUpdate ? kStateClass : kAccumClass;
        writes = finish_stage(static_cast<std::size_t>(job.layer), dirty,
                              job.kind == JobKind::kUpdate, &wrote);
      }
      // A failed measurement is its caller's error (grad_info, grad_read), not the
      // optimizer's: it only read sums.
      if (!status.is_ok() && job.kind != JobKind::kMeasure) {
        fail(error(status.code(), "optimizer: grads of layer ", job.layer,
                   " did not land: ", status.message()));
      }
      if (job.kind == JobKind::kMeasure) {
        finish_measure(job, status);
      } else if (job.kind == JobKind::kLand || job.kind == JobKind::kStash) {
        const auto l = static_cast<std::size_t>(job.layer);
        for (std::size_t k = 0; k < layer_params_[l].size(); ++k) {
          Param& p = params_[layer_params_[l][k]];
          // A kStash entry that moved nothing leaves the param's sum as it was; an in-place
          // sum is measured when asked (its landing copied nothing).
          if (p.in_place) continue;
          if (job.kind == JobKind::kLand || job.add[k] != 0) p.grad_sq = job.sums[k];
        }
        --landing_[l];
        --pending_[l];
      } else if (job.kind == JobKind::kNorm && job.scalars->aborted) {
        --pending_[static_cast<std::size_t>(job.layer)];  // its update will never be queued
      } else if (job.kind == JobKind::kNorm) {
        StepScalars& step = *job.scalars;
        step.norm_squared += norm;
        step.normed.push_back(job.layer);
        if (++step.norms_in == layers_with_params_) {
          // Every grad is in: decide the step, then update in forward order, which is the
          // order the next step's forward pass loads the layers in.
          finish_norms(step.norm_squared, &step);
          for (std::size_t l = 0; l < layer_params_.size(); ++l) {
            if (layer_params_[l].empty()) continue;
            Job u;
            u.kind = JobKind::kUpdate;
            u.layer = static_cast<int>(l);
            u.scalars = job.scalars;
            queue_.push_back(std::move(u));
          }
        }
      } else {
        const auto l = static_cast<std::size_t>(job.layer);
        // A layer with NVMe-homed weights is loadable once they are written back
        // (on_stage_io lets go of the count then).
        if (wrote && stages_[l].holds_weights) {
          stages_[l].pending_held = true;
        } else {
          --pending_[l];
        }
      }
    }
    cv_.notify_all();
    start_io(writes);
  }
}

}  // namespace strata
