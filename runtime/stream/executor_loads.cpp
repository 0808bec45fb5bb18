// The executor's loads: which positions are issued when (issue_loads), and how one position's
// layer gets into its slot (issue_load): reused in place, or its weights brought in by one of
// three strategies chosen by where they live, then its checkpoints and zeroed grad buffers.
#include <algorithm>

#include "runtime/stream/executor.h"

namespace strata {

std::vector<std::shared_ptr<DeviceFence>> Executor::slot_free_fences(std::size_t p) const {
  const ScheduledPosition& sched = schedule_[p];
  const Slot& slot = slots_[sched.slot];
  std::vector<std::shared_ptr<DeviceFence>> fences;
  if (slot.outbound) fences.push_back(slot.outbound);
  if (!(sched.reuse && !slot.weight_ready.empty()) && slot.consumer)
    fences.push_back(slot.consumer);
  return fences;
}

Status Executor::issue_loads(long must) {
  while (issued_ < sequence_.size() && issued_ <= cursor_ + plan_.forward_depth) {
    const bool needed = static_cast<long>(issued_) <= must;
    // The optimizer may still be writing this layer's weights in DRAM.
    const uint32_t layer = sequence_[issued_].layer;
    if (hooks_ && !hooks_->layer_ready(layer)) {
      if (!needed) return Status::ok();
      STRATA_RETURN_IF_ERROR(hooks_->wait_layer(layer));
    }
    for (const auto& f : slot_free_fences(issued_)) {
      if (needed) {
        STRATA_RETURN_IF_ERROR(f->host_wait());
      } else if (!f->is_done()) {
        return Status::ok();  // retried at the next acquire or release
      }
    }
    STRATA_RETURN_IF_ERROR(issue_load(issued_));
    ++issued_;
  }
  return Status::ok();
}

Status Executor::issue_load(std::size_t p) {
  const StepPosition& pos = sequence_[p];
  const ScheduledPosition& sched = schedule_[p];
  const LayerPlan& layer = plan_.layers[pos.layer];
  const LayerHomes& homes = homes_[pos.layer];
  Slot& slot = slots_[sched.slot];
  unsigned char* base = slot_base(sched.slot);
  Ready& ready = ready_[p];
  const bool backward = pos.phase == Phase::kBackward;
  // What the load does with the grads kept in their HBM homes, asked before anything is queued
  // (an error leaves the position unissued, to be retried whole).
  std::vector<HomeGrad> modes;
  if (backward) {
    std::vector<TensorId> in_home;
    for (const SlotTensor& g : layer.grads) {
      if (g.in_home) in_home.push_back(g.id);
    }
    modes.assign(in_home.size(), HomeGrad::kBuffer);
    if (hooks_ && !in_home.empty()) {
      STRATA_RETURN_IF_ERROR(hooks_->on_backward_load(pos.layer, in_home, &modes));
    }
  }
  ++stats_.loads;

  // Before anything lands in the slot: its previous user is done with it, and what it sent out
  // has left.
  const std::vector<std::shared_ptr<DeviceFence>> slot_free = slot_free_fences(p);
  if (sched.reuse && !slot.weight_ready.empty()) {
    ++stats_.reused_loads;
    ready.weights = slot.weight_ready;
    ready.activations = slot.activation_ready;
  } else {
    slot.weight_ready.clear();
    slot.activation_ready.clear();
    if (!homes.nvme_weights.empty()) {
      load_weights_from_nvme(layer, homes, base, slot_free, &ready);
    } else if (layer.weights_as_span) {
      STRATA_RETURN_IF_ERROR(load_weights_as_span(layer, homes, base, slot_free, &ready));
    } else {
      STRATA_RETURN_IF_ERROR(load_weights_per_tensor(layer, homes, base, slot_free, &ready));
    }
    if (backward) {
      // Checkpoints come back from DRAM, after the forward pass sent them there.
      std::vector<std::shared_ptr<DeviceFence>> after = slot_free;
      if (activations_out_[pos.layer]) after.push_back(activations_out_[pos.layer]);
      for (std::size_t i = 0; i < layer.activations.size(); ++i) {
        std::shared_ptr<DeviceFence> f;
        STRATA_RETURN_IF_ERROR(queue_copy(CopyDirection::kHostToDevice,
                                          base + layer.activations[i].offset, homes.activations[i],
                                          layer.activations[i].bytes, after, &f));
        ready.activations.push_back(std::move(f));
        stats_.bytes_in += layer.activations[i].bytes;
      }
    }
    slot.weight_ready = ready.weights;
    slot.activation_ready = ready.activations;
  }
  if (backward && !layer.grads.empty()) {
    // Grad buffers start at zero, so the framework can accumulate micro-batches into them: the
    // slot's grad range in one fill, each grad kept in its HBM home on its own (its last
    // reader, the optimizer's update of the step before, was done before this load: the
    // hooks gate it). An HBM home that is an optimizer's in-place gradient sum holding grads
    // is not filled (modes, asked above): the framework adds this backward pass's grad to it.
    ready.grads.assign(layer.grads.size(), nullptr);
    ready.grad_sums.assign(layer.grads.size(), 0);
    uint64_t first = UINT64_MAX, end = 0;
    std::size_t home = 0;
    for (std::size_t i = 0; i < layer.grads.size(); ++i) {
      const SlotTensor& g = layer.grads[i];
      if (g.in_home) {
        const HomeGrad mode = modes[home++];
        ready.grad_sums[i] = mode == HomeGrad::kBuffer ? 0 : 1;
        if (mode == HomeGrad::kHeldSum) continue;  // nothing to wait for: ready.grads[i] null
        STRATA_RETURN_IF_ERROR(queue_copy(CopyDirection::kHostToDevice, homes.grads[i], nullptr,
                                          g.bytes, slot_free, &ready.grads[i]));
        continue;
      }
      first = std::min(first, g.offset);
      end = std::max(end, g.offset + g.bytes);
    }
    if (end > 0) {
      std::shared_ptr<DeviceFence> f;
      STRATA_RETURN_IF_ERROR(queue_copy(CopyDirection::kHostToDevice, base + first, nullptr,
                                        end - first, slot_free, &f));
      for (std::size_t i = 0; i < layer.grads.size(); ++i) {
        if (!layer.grads[i].in_home) ready.grads[i] = f;
      }
    }
  }
  return Status::ok();
}

// Chosen when the layer's weights live on NVMe (homes.nvme_weights; the planner's
// weights_on_nvme). No device copy reads a disk, so the NVMe tier's host threads read each weight
// and stage it to the device through its pinned staging slots, after the slot is free. Each
// weight is ready with a host-side Completion, which is why acquiring such a layer blocks the
// calling thread.
void Executor::load_weights_from_nvme(const LayerPlan& layer, const LayerHomes& homes,
                                      unsigned char* base,
                                      const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                                      Ready* ready) {
  NvmeTier* nvme = runtime_->nvme_tier();
  for (std::size_t i = 0; i < homes.nvme_weights.size(); ++i) {
    const TensorRecord& r = homes.nvme_weights[i];
    auto done = std::make_shared<Completion>();
    nvme->read_to_device(
        r.spec.name, base + layer.weights[i].offset, r.nbytes, r.offset,
        Arena::round_up(r.nbytes, NvmeTier::kAlignment), r.nvme_crcs,
        [done](Status s) { done->complete(std::move(s)); }, slot_free);
    ready->weights.push_back(std::make_shared<CompletionFence>(done));
    stats_.bytes_in += r.nbytes;
  }
}

// Chosen when the layer's weights sit in DRAM nearly back to back (the planner sets
// weights_as_span when their extent is at most 1/8 larger than the weights themselves, as for
// tensors registered one after the other): the extent is laid out in the slot as it is in DRAM
// and travels in copies cut at tensor ends, each at least chunk_bytes. Small tensors merge and
// large ones go whole (one copy of any size runs at the link's peak), so the host queues a few
// large copies rather than one per tensor (docs/architecture.md, "Copies"). A tensor is ready
// with the chunk that holds it; only the first chunk waits for the slot (the queue is in order).
Status Executor::load_weights_as_span(const LayerPlan& layer, const LayerHomes& homes,
                                      unsigned char* base,
                                      const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                                      Ready* ready) {
  std::vector<std::size_t> order(layer.weights.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return layer.weights[a].offset < layer.weights[b].offset;
  });
  ready->weights.resize(layer.weights.size());
  uint64_t chunk_start = 0;
  std::vector<std::size_t> members;
  for (std::size_t k = 0; k < order.size(); ++k) {
    members.push_back(order[k]);
    const uint64_t end =
        k + 1 < order.size() ? layer.weights[order[k + 1]].offset : layer.span_bytes;
    if (end - chunk_start < plan_.config.chunk_bytes && k + 1 < order.size()) continue;
    std::shared_ptr<DeviceFence> f;
    STRATA_RETURN_IF_ERROR(
        queue_copy(CopyDirection::kHostToDevice, base + chunk_start, homes.span + chunk_start,
                   end - chunk_start,
                   chunk_start == 0 ? slot_free : std::vector<std::shared_ptr<DeviceFence>>{}, &f));
    for (std::size_t m : members) ready->weights[m] = f;
    members.clear();
    chunk_start = end;
  }
  stats_.bytes_in += layer.span_bytes;
  return Status::ok();
}

// Chosen for weights in DRAM that are too scattered to copy as one extent (its gaps would cost
// more than the copies they save): one copy per tensor, each ready with its own fence; only the
// first waits for the slot (the queue is in order).
Status Executor::load_weights_per_tensor(const LayerPlan& layer, const LayerHomes& homes,
                                         unsigned char* base,
                                         const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                                         Ready* ready) {
  for (std::size_t i = 0; i < layer.weights.size(); ++i) {
    std::shared_ptr<DeviceFence> f;
    STRATA_RETURN_IF_ERROR(
        queue_copy(CopyDirection::kHostToDevice, base + layer.weights[i].offset, homes.weights[i],
                   layer.weights[i].bytes,
                   i == 0 ? slot_free : std::vector<std::shared_ptr<DeviceFence>>{}, &f));
    ready->weights.push_back(std::move(f));
    stats_.bytes_in += layer.weights[i].bytes;
  }
  return Status::ok();
}

}  // namespace strata
