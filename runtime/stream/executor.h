// Executor: runs a Plan, step after step. The framework brackets each layer's compute with
// acquire / release, forward 0..L-1 then backward L-1..0; the executor keeps `depth` layers
// loading ahead in the other slots, on the H2D queue, while the caller's stream computes, and
// sends activations (forward) and grads (backward) out on the D2H queue after each release.
// Every dependency is a device-side fence: a slot is refilled only after the caller's stream
// has finished with it (a fence recorded at release) and its outbound copies have left; the
// caller's stream waits for a layer's copies (fences per chunk: a tensor is ready when the
// chunk holding its last byte has landed). The calling thread blocks only where a host thread
// does the work (weights homed on NVMe) or at step_end (grads must have landed).
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "runtime/runtime.h"
#include "runtime/stream/executor_hooks.h"
#include "runtime/stream/planner.h"

namespace strata {

struct LayerViews {
  std::vector<void*> weights, grads, activations;  // in declared order
};

struct ExecutorStats {
  uint64_t steps = 0;
  uint64_t loads = 0;         // layer loads issued
  uint64_t reused_loads = 0;  // positions whose layer was still in its slot
  uint64_t bytes_in = 0;      // bytes queued DRAM/NVMe -> HBM
  uint64_t bytes_out = 0;     // bytes queued HBM -> DRAM
};

enum class ViewRole : int32_t { kWeight = 0, kGrad = 1, kActivation = 2 };

class Executor {
 public:
  static Status create(std::shared_ptr<Runtime> runtime, Plan plan, std::unique_ptr<Executor>* out);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  const Plan& plan() const { return plan_; }
  Runtime& runtime() const { return *runtime_; }
  ExecutorStats stats();

  Status step_begin();
  Status step_end();
  // Abandons the running step (a no-op without one): an acquired layer is released on `stream`
  // without sending anything out, layers not yet run are dropped, and the call blocks until
  // the step's copies are done. Grads already queued (layers whose backward was released)
  // still land and reach the optimizer, as a framework's autograd would have accumulated them.
  Status step_abort(void* stream);
  // Between step_begin and step_end (checkpoints of the runtime's tensors refuse to run then).
  bool in_step();
  // How acquire waits for the layer's data: the stream (device-side), not at all (the caller
  // uses wait_tensor() per tensor), or the calling thread (for frameworks whose streams Strata
  // cannot see, such as XLA's).
  enum class Wait { kStream, kNone, kHost };
  Status acquire(uint32_t layer, Phase phase, void* stream, Wait wait, LayerViews* views);
  Status wait_tensor(uint32_t layer, Phase phase, ViewRole role, uint32_t index, void* stream);
  Status release(uint32_t layer, Phase phase, void* stream);
  // The device address and tensor of one view of the acquired layer (for DLPack export).
  Status view(uint32_t layer, Phase phase, ViewRole role, uint32_t index, void** data,
              TensorId* tensor);
  // Copies `bytes` (the view's size) from device or host memory into a view, synchronously:
  // for frameworks whose arrays are immutable (JAX), which cannot write into a view.
  Status write_view(uint32_t layer, Phase phase, ViewRole role, uint32_t index, const void* src,
                    uint64_t bytes);

  // A service that runs beside the steps (the optimizer): told when grads leave, asked before
  // a layer's weights are loaded. One at a time, attached and detached between steps.
  Status attach_hooks(std::shared_ptr<ExecutorHooks> hooks);
  Status detach_hooks(const ExecutorHooks* hooks);

 private:
  struct Slot {
    std::shared_ptr<DeviceFence> consumer;  // the last user's stream, at its release
    std::shared_ptr<DeviceFence> outbound;  // the last D2H copy out of the slot
    std::vector<std::shared_ptr<DeviceFence>> weight_ready, activation_ready;
  };
  struct Ready {
    // Null where nothing is waited for (an in-place gradient sum kept as it is).
    std::vector<std::shared_ptr<DeviceFence>> weights, grads, activations;
    // Backward: per grad, whether its view is an in-place gradient sum (HomeGrad), which the
    // framework adds to and write_view refuses to copy over.
    std::vector<uint8_t> grad_sums;
  };

  Executor(std::shared_ptr<Runtime> runtime, Plan plan);
  Status check_position(uint32_t layer, Phase phase, const char* verb) const;
  // acquire's waits for the layer's data, without mutex_ (except to record trace waits).
  Status wait_for_layer(uint32_t layer, Phase phase, void* stream, Wait wait,
                        std::vector<std::shared_ptr<DeviceFence>> waits);
  // check_position, and the layer is the acquired one.
  Status check_acquired(uint32_t layer, Phase phase, const char* verb) const;
  unsigned char* slot_base(uint32_t slot) const;
  // Issues the loads the prefetch window allows whose slots are free on the device. Loads up
  // to position `must` (if >= 0) are issued even if that means waiting for their slots: the
  // caller needs them now. Keeping unissued what cannot start yet bounds how far the host
  // runs ahead of the device, so CUDA's work queues never fill and block the host.
  Status issue_loads(long must = -1);  // under mutex_ (executor_loads.cpp, as the next three)
  Status issue_load(std::size_t position);
  std::vector<std::shared_ptr<DeviceFence>> slot_free_fences(std::size_t position) const;
  // Queues one copy (src null: zero fill) after `wait_for`; *last receives its fence.
  Status queue_copy(CopyDirection direction, unsigned char* dst, const unsigned char* src,
                    uint64_t bytes, const std::vector<std::shared_ptr<DeviceFence>>& wait_for,
                    std::shared_ptr<DeviceFence>* last);
  Status wait_all_outstanding();
  // Waits for the step's outbound copies (their first error is the result) and for abandoned
  // loads (errors ignored), counts its copies and emits its trace records.
  Status finish_step(std::vector<std::shared_ptr<DeviceFence>> outbound,
                     std::vector<std::shared_ptr<DeviceFence>> abandoned = {});
  // Emits the acquire and release trace records once their device-side times are known.
  Status resolve_waits();
  struct PendingWait {
    TraceRecord record;
    std::shared_ptr<DeviceFence> before, after;
  };
  std::vector<PendingWait> pending_waits_;
  // Copies of this step, counted on their links (and traced) at step_end from their fences:
  // no completion-thread work per copy while the step runs.
  struct PendingCopy {
    CopyDirection direction;
    uint64_t bytes;
    std::vector<std::shared_ptr<DeviceFence>> deps;
    std::shared_ptr<DeviceFence> end;
  };
  std::vector<PendingCopy> pending_copies_;
  std::shared_ptr<DeviceFence> last_end_[2];  // per direction, across steps
  Status resolve_copies();
  // Nanoseconds `bytes` take at `bytes_per_second`, capped (never undefined for tiny rates).
  static int64_t planned_ns(uint64_t bytes, double bytes_per_second);

  std::shared_ptr<Runtime> runtime_;
  std::shared_ptr<DeviceBackend> backend_;
  Plan plan_;
  std::vector<StepPosition> sequence_;
  std::vector<ScheduledPosition> schedule_;
  uint64_t slots_offset_ = 0;
  bool slots_reserved_ = false;
  std::vector<TensorId> pinned_;
  // Where each layer's tensors live (stable: the executor pins them in place).
  struct LayerHomes {
    unsigned char* span = nullptr;           // DRAM span of the weights, when weights_as_span
    std::vector<unsigned char*> weights;     // per weight in DRAM
    std::vector<TensorRecord> nvme_weights;  // per weight on NVMe (extent, checksums)
    std::vector<unsigned char*> grads, activations;  // a grad in HBM: its device address
  };
  std::vector<LayerHomes> homes_;
  // Where grad `index` of a layer is written in the backward pass: its slot space, or its home
  // (SlotTensor::in_home).
  unsigned char* grad_view(const LayerPlan& lp, const LayerHomes& homes, unsigned char* base,
                           std::size_t index) const;

  // issue_load's three ways to bring a layer's weights into its slot, chosen by where they live
  // (executor_loads.cpp says when and why): each fills ready->weights (one fence per weight, in
  // declared order), counts stats_.bytes_in, and starts nothing before `slot_free`.
  void load_weights_from_nvme(const LayerPlan& layer, const LayerHomes& homes, unsigned char* base,
                              const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                              Ready* ready);
  Status load_weights_as_span(const LayerPlan& layer, const LayerHomes& homes, unsigned char* base,
                              const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                              Ready* ready);
  Status load_weights_per_tensor(const LayerPlan& layer, const LayerHomes& homes,
                                 unsigned char* base,
                                 const std::vector<std::shared_ptr<DeviceFence>>& slot_free,
                                 Ready* ready);

  std::mutex mutex_;
  std::shared_ptr<ExecutorHooks> hooks_;
  std::vector<Slot> slots_;
  std::vector<Ready> ready_;                                   // per position of the current step
  std::vector<std::shared_ptr<DeviceFence>> activations_out_;  // per layer, forward outbound
  // The last backward release that left grads in their HBM homes (SlotTensor::in_home): they
  // have landed once the caller's stream got there, which step_end waits for as it waits for
  // the copies of grads homed in DRAM.
  std::shared_ptr<DeviceFence> home_grads_landed_;
  bool in_step_ = false;
  bool acquired_ = false;
  bool acquiring_ = false;  // an acquire is waiting for its layer's data (without mutex_)
  std::size_t cursor_ = 0;  // the position to acquire next
  std::size_t issued_ = 0;  // positions whose loads are queued
  ExecutorStats stats_;
};

}  // namespace strata
