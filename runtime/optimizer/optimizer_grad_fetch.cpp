// Grads homed in HBM: the backward pass leaves each layer's grads on the device, and every job
// that reads them (norm, accumulation, update, explicit mode's landing and stash) first queues
// the copies of its tasks' grads into one DRAM buffer, the size of the largest layer's grads
// (a copy per run of a param's tasks, up to 16 MiB), and each task waits for the one it is in. DRAM
// then holds no grad per parameter (2 bytes per bf16 parameter less: 12 bytes per parameter
// with split masters instead of 14), for the price of the grads' HBM and of one more PCIe copy
// per read (docs/optimizer.md, "Grads on the device").
#include "runtime/optimizer/optimizer.h"

#include <algorithm>

#include "runtime/optimizer/layout_sizes.h"

namespace strata {

namespace {
// Consecutive tasks of one param share a copy of up to this many bytes: one copy per task
// (~2 MB each, 220 for an 8B block) cost the dispatcher ~7 ms of submissions per job before
// its first task could start (H200 trace, 2.0B all streamed), one per param would make the
// first tasks wait for a whole 117 MB matrix.
constexpr uint64_t kFetchChunkBytes = 16ull << 20;
}  // namespace

Status Optimizer::layout_grad_fetch() {
  free_grad_fetch();
  if (hbm_grad_params_ == 0) return Status::ok();
  uint64_t largest = 0;
  for (const auto& layer : layer_params_) {
    uint64_t offset = 0;
    for (std::size_t i : layer) {
      Param& p = params_[i];
      if (!p.hbm_grad) continue;
      p.fetch_offset = offset;
      offset += grad_fetch_span(p.arrays.count, dtype_size(p.arrays.grad_dtype));
    }
    largest = std::max(largest, offset);
  }
  // Role kGrad: the GPU's copies write it, so it belongs in the arena's pinned part.
  Status s = make_buffer("grad_fetch", largest, "optimizer grad fetch", Role::kGrad,
                         &grad_fetch_id_, &grad_fetch_base_);
  if (!s.is_ok()) {
    return error(s.code(), "optimizer: a DRAM buffer to read HBM-homed grads through (", largest,
                 " bytes, the largest layer's grads): ", s.message());
  }
  grad_fetch_bytes_ = largest;
  for (Param& p : params_) {
    if (p.hbm_grad) p.arrays.grad = grad_fetch_base_ + p.fetch_offset;
  }
  return Status::ok();
}

void Optimizer::free_grad_fetch() {
  drop_buffer(&grad_fetch_id_);
  grad_fetch_base_ = nullptr;
  grad_fetch_bytes_ = 0;
  for (Param& p : params_) {
    if (p.hbm_grad) p.arrays.grad = nullptr;
  }
}

bool Optimizer::reads_grad(const Job& job, const Param& p) {
  switch (job.kind) {
    case JobKind::kAccumulate:
    case JobKind::kNorm:
      return true;
    case JobKind::kLand:
      return !p.in_place;  // an in-place sum is measured when asked, not at each landing
    case JobKind::kStash:
      return job.add[p.in_layer] != 0;
    case JobKind::kMeasure:
      return job.add[p.in_layer] != 0 || (job.read && job.read->slot == p.in_layer);
    case JobKind::kUpdate:
      if (job.sources.empty()) return true;
      // Explicit mode: the held grad, not the fp32 accumulator or a zero grad.
      return !job.sources[p.in_layer].skip && job.sources[p.in_layer].grad == p.arrays.grad;
  }
  return false;
}

bool Optimizer::Arrivals::wait(std::size_t k) {
  if (k >= fences.size() || !fences[k]) return true;
  Status s = fences[k]->host_wait();
  if (s.is_ok()) return true;
  std::lock_guard lock(mutex);
  if (failed.is_ok()) failed = std::move(s);
  return false;
}

Status Optimizer::Arrivals::drain() {
  // Every submitted copy ends before the buffer is anyone else's (errors: the first one).
  for (auto& f : fences) {
    if (!f) continue;
    Status s = f->host_wait();
    if (!s.is_ok() && failed.is_ok()) failed = std::move(s);
  }
  fences.clear();
  return failed;
}

Status Optimizer::fetch_grads(std::span<const Task> tasks, const Job& job, Arrivals* arrivals) {
  arrivals->fences.assign(tasks.size(), nullptr);
  if (hbm_grad_params_ == 0) return Status::ok();
  for (std::size_t k = 0; k < tasks.size();) {
    const Param& p = params_[tasks[k].param];
    if (!p.hbm_grad || !reads_grad(job, p)) {
      ++k;
      continue;
    }
    // Tasks k..last-1: one param's consecutive, adjacent slices, one copy.
    const uint64_t elem = dtype_size(p.arrays.grad_dtype);
    std::size_t last = k + 1;
    while (last < tasks.size() && tasks[last].param == tasks[k].param &&
           tasks[last].begin == tasks[last - 1].end &&
           (tasks[last].end - tasks[k].begin) * elem <= kFetchChunkBytes)
      ++last;
    CopyRequest r;
    r.direction = CopyDirection::kDeviceToHost;
    r.dst = grad_fetch_base_ + p.fetch_offset + tasks[k].begin * elem;
    r.src = p.grad_device + tasks[k].begin * elem;
    r.bytes = (tasks[last - 1].end - tasks[k].begin) * elem;
    // In the D2H link's counters and the trace, as the executor's copies are. (The runtime
    // outlives its backend's completion thread, as for Runtime::start_transfer's copies.)
    r.on_complete = [rt = runtime_.get(), bytes = r.bytes](CopyResult result) {
      if (result.status.is_ok()) rt->account(Link::kD2H, bytes, result.busy_ns);
    };
    Status s = runtime_->backend()->submit_copy(std::move(r), &arrivals->fences[k]);
    if (!s.is_ok()) {
      (void)arrivals->drain();
      return fetch_failed(job.layer, s);
    }
    for (std::size_t j = k + 1; j < last; ++j) arrivals->fences[j] = arrivals->fences[k];
    k = last;
  }
  return Status::ok();
}

Status Optimizer::fetch_failed(int layer, const Status& s) {
  return error(s.code(), "optimizer: fetching layer ", layer, "'s grads from HBM: ", s.message());
}

}  // namespace strata
