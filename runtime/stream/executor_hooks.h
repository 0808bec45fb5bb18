// ExecutorHooks: how a service working beside the executor (the optimizer) sees a step. The
// executor calls them under its own lock, so they must not call back into the executor; only
// wait_layer() and on_backward_load() may block, and only on work that needs nothing from the
// executor.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/device/device_backend.h"
#include "common/status.h"
#include "runtime/memory/tensor_registry.h"  // TensorId

namespace strata {

// What a backward load does with a grad kept in its HBM home (SlotTensor::in_home).
enum class HomeGrad : uint8_t {
  kBuffer = 0,    // a grad buffer: zero-filled, the backward pass writes the grad
  kEmptySum = 1,  // an in-place sum that holds nothing yet: zero-filled, then added to
  kHeldSum = 2,   // an in-place sum holding the grads so far: kept as it is, added to
};

class ExecutorHooks {
 public:
  virtual ~ExecutorHooks() = default;
  // A step begins (before any load is issued); an error fails strata_step_begin.
  virtual Status on_step_begin() = 0;
  // The backward load of `layer` is being queued: for each of `grads` (its grads kept in their
  // HBM homes, in declared order) what the load does with it (*modes, one entry each). May block
  // on copies of those homes (a scale pending on a held sum is applied first); an error fails
  // the load.
  virtual Status on_backward_load(uint32_t layer, const std::vector<TensorId>& grads,
                                  std::vector<HomeGrad>* modes) = 0;
  // The layer's backward acquire succeeded: the framework adds into its grad views from now on,
  // until the release (on_grads_queued) or an abort (on_step_aborted).
  virtual void on_backward_acquired(uint32_t layer) = 0;
  // A layer's backward release queued its grads to DRAM; `landed` fences their copies.
  virtual Status on_grads_queued(uint32_t layer,
                                 std::vector<std::shared_ptr<DeviceFence>> landed) = 0;
  // The step ended (after its last release; its grads may still be landing).
  virtual void on_step_end() = 0;
  // The step was abandoned (strata_step_abort): grads queued so far still land; no more come.
  // `adds_done` (null if no layer was acquired) fences the acquired layer's work on the
  // framework's stream: its adds into the grad views may run until it is done (the abort
  // waits for it only after this call).
  virtual void on_step_aborted(std::shared_ptr<DeviceFence> adds_done) = 0;
  // Whether the layer's weights in DRAM may be loaded now (no update of them is running).
  virtual bool layer_ready(uint32_t layer) = 0;
  // Blocks until they may; returns the service's error if its work failed.
  virtual Status wait_layer(uint32_t layer) = 0;
  // The executor is going away: forget it (its fences stay valid while they are held).
  virtual void on_executor_destroyed() = 0;
};

}  // namespace strata
