// DeviceBackend: what the runtime core needs from a device, and nothing more. The core includes
// only this header, never cuda_runtime.h, so the same core (and the same conformance suite)
// runs on every backend: `cuda` on a GPU, `host` (a simulated device) everywhere else.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata {

enum class DeviceKind : int32_t { kAuto = 0, kCuda = 1, kHost = 2 };

// The direction of an asynchronous copy; each direction has its own in-order copy queue
// (a non-blocking stream on cuda, a worker thread on host), so H2D and D2H overlap.
enum class CopyDirection : int { kHostToDevice = 0, kDeviceToHost = 1 };
inline constexpr int kCopyDirectionCount = 2;

struct DeviceDescription {
  DeviceKind kind = DeviceKind::kHost;
  int32_t ordinal = 0;
  std::string name;
  std::string pci_bus_id;    // "0000:65:00.0" on cuda, empty on host
  uint64_t free_memory = 0;  // device memory free at start-up (cuda), 0 on host
  uint64_t total_memory = 0;
};

// Something a foreign stream can be made to wait on: the end of one submitted copy.
class DeviceFence {
 public:
  virtual ~DeviceFence() = default;
  // Make `stream` (a cudaStream_t on cuda) wait for the copy without blocking the caller.
  // The host backend has no streams, so there it blocks the calling thread until the copy ends.
  virtual Status enqueue_wait(void* stream) = 0;
  // Block the calling thread until the fenced work is done.
  virtual Status host_wait() = 0;
  // Whether the fenced work is done, without blocking.
  virtual bool is_done() const = 0;
  // Nanoseconds between an earlier fence of the same backend and this one, both done.
  virtual Status elapsed_since(const DeviceFence& earlier, uint64_t* ns) const = 0;
};

struct CopyResult {
  Status status;
  uint64_t busy_ns = 0;  // time the copy occupied its queue (device-timed on cuda)
};

// Called exactly once per successfully submitted copy, from a backend thread, never while the
// submitter holds a backend lock. Must not call back into submit_copy of the same backend.
using CopyCallback = std::function<void(CopyResult)>;

struct CopyRequest {
  CopyDirection direction = CopyDirection::kHostToDevice;
  void* dst = nullptr;
  // Null: fill `bytes` of dst with zeros instead of copying.
  const void* src = nullptr;
  uint64_t bytes = 0;
  // The copy starts only after all work already submitted to this stream (cuda). May be null.
  void* after_stream = nullptr;
  // ... and after each of these fences (work on other queues or streams, recorded earlier).
  std::vector<std::shared_ptr<DeviceFence>> wait_for;
  // May be empty: then nothing is reported (the fence still tells when it is done), and on
  // cuda the copy costs the queue no completion work and no timing events.
  CopyCallback on_complete;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual const DeviceDescription& description() const = 0;

  // Start-up work only, never on the hot path: the HBM arena's allocation, and pinning the DRAM
  // arena (host memory the runtime mapped and placed) for asynchronous DMA.
  virtual Status allocate_device(uint64_t bytes, void** out) = 0;
  virtual void free_device(void* ptr, uint64_t bytes) = 0;
  virtual Status pin_host(void* ptr, uint64_t bytes) = 0;
  virtual void unpin_host(void* ptr, uint64_t bytes) = 0;

  // Queue an asynchronous copy in its direction's queue. On success the callback will run
  // exactly once and *fence (if not null) can make other streams wait for the copy. On failure
  // the callback never runs.
  virtual Status submit_copy(CopyRequest request, std::shared_ptr<DeviceFence>* fence) = 0;

  // Synchronous copy between any host memory and device or pinned memory (either direction).
  virtual Status copy_sync(void* dst, const void* src, uint64_t bytes) = 0;

  // A fence for all work submitted to `stream` so far (cuda: an event recorded on it). On the
  // host backend, where the caller's work is done when it calls, the fence is already done.
  virtual Status record_fence(void* stream, std::shared_ptr<DeviceFence>* out) = 0;

  // Stop accepting copies, wait for the running ones, cancel what never started (its callbacks
  // run with kCancelled). Returns how many were cancelled. Idempotent.
  virtual std::size_t shutdown() = 0;
};

// Options the factory passes on; each backend rejects those that do not apply to it.
struct DeviceOptions {
  DeviceKind kind = DeviceKind::kAuto;
  int32_t ordinal = 0;
  uint64_t host_link_bytes_per_second = 0;  // host backend only
  // Tests only, host backend only: asked before each copy (submitted or synchronous) with its
  // destination, source (null: a zero fill) and size; a status other than OK fails the copy
  // with it (submit_copy or copy_sync returns it, nothing is copied), as a device fault would.
  std::function<Status(const void* dst, const void* src, uint64_t bytes)> copy_fault;
};

// Create the backend `options.kind` names; for kAuto, cuda where a usable GPU is present and
// host otherwise. *reason says which was chosen and why (shown in the capabilities).
Status create_device_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out,
                             std::string* reason);

// Whether this build contains the cuda backend.
bool cuda_backend_compiled();

}  // namespace strata
