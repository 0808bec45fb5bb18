#include "backends/device/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "common/spawn.h"

namespace strata {
namespace {

Status cuda_error(cudaError_t err, const char* what) {
  return error(Code::kBackend, what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
               ")");
}

#define STRATA_CUDA_RETURN(expr, what)                                    \
  do {                                                                    \
    cudaError_t strata_err_ = (expr);                                     \
    if (strata_err_ != cudaSuccess) return cuda_error(strata_err_, what); \
  } while (0)

// CUDA's current device is per host thread and belongs to the caller (PyTorch sets it too), so
// every entry point switches to our device and restores the caller's on the way out.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Events are recycled rather than created per copy. BlockingSync lets the completion thread
// sleep in cudaEventSynchronize instead of spinning a core.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    DeviceGuard guard(device_);
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }

  // An event that returns to the pool when the last reference goes.
  Status acquire(std::shared_ptr<CUevent_st>* out) {
    cudaEvent_t event = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        event = free_.back();
        free_.pop_back();
      }
    }
    if (event == nullptr) {
      STRATA_CUDA_RETURN(cudaEventCreateWithFlags(&event, cudaEventBlockingSync),
                         "cudaEventCreateWithFlags");
    }
    auto self = shared_from_this();
    *out = std::shared_ptr<CUevent_st>(event, [self](cudaEvent_t e) { self->release(e); });
    return Status::ok();
  }

 private:
  void release(cudaEvent_t event) {
    std::lock_guard lock(mutex_);
    free_.push_back(event);
  }

  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

using EventRef = std::shared_ptr<CUevent_st>;

class CudaFence final : public DeviceFence {
 public:
  CudaFence(int device, EventRef event) : device_(device), event_(std::move(event)) {}
  Status enqueue_wait(void* stream) override {
    DeviceGuard guard(device_);
    STRATA_CUDA_RETURN(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_.get(), 0),
                       "cudaStreamWaitEvent");
    return Status::ok();
  }
  Status host_wait() override {
    STRATA_CUDA_RETURN(cudaEventSynchronize(event_.get()), "cudaEventSynchronize");
    return Status::ok();
  }
  bool is_done() const override { return cudaEventQuery(event_.get()) != cudaErrorNotReady; }
  Status elapsed_since(const DeviceFence& earlier, uint64_t* ns) const override {
    const auto* e = dynamic_cast<const CudaFence*>(&earlier);
    if (e == nullptr) return error(Code::kInternal, "fences of different backends");
    float ms = 0;
    STRATA_CUDA_RETURN(cudaEventElapsedTime(&ms, e->event_.get(), event_.get()),
                       "cudaEventElapsedTime");
    *ns = static_cast<uint64_t>(std::max(0.0f, ms) * 1e6f);
    return Status::ok();
  }

 private:
  int device_;
  EventRef event_;
};

// One direction: a non-blocking stream (so it never serializes with the legacy default stream)
// and a thread that waits for each copy's end event in order and reports it.
class CudaCopyQueue {
 public:
  CudaCopyQueue(int device, std::shared_ptr<EventPool> pool)
      : device_(device), pool_(std::move(pool)) {}
  ~CudaCopyQueue() { shutdown(); }

  Status start() {
    DeviceGuard guard(device_);
    STRATA_CUDA_RETURN(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
    // A refused thread is OUT_OF_MEMORY naming it; shutdown() still destroys the stream.
    return spawn_thread(
        "a cuda copy completion", [this] { run(); }, &completer_);
  }

  Status submit(CopyRequest request, std::shared_ptr<DeviceFence>* fence) {
    DeviceGuard guard(device_);
    // Copies nobody waits to hear about (the executor's) need neither timing nor the
    // completion thread: one event, the fence, is all they cost.
    const bool report = static_cast<bool>(request.on_complete);
    EventRef start, end, after;
    if (report) STRATA_RETURN_IF_ERROR(pool_->acquire(&start));
    STRATA_RETURN_IF_ERROR(pool_->acquire(&end));
    std::lock_guard lock(mutex_);  // keeps the stream's order equal to the pending queue's
    if (stopping_) return error(Code::kInvalidState, "cuda backend: copy queue is shut down");
    if (request.after_stream != nullptr) {
      STRATA_RETURN_IF_ERROR(pool_->acquire(&after));
      STRATA_CUDA_RETURN(
          cudaEventRecord(after.get(), static_cast<cudaStream_t>(request.after_stream)),
          "cudaEventRecord on the caller's stream");
      STRATA_CUDA_RETURN(cudaStreamWaitEvent(stream_, after.get(), 0), "cudaStreamWaitEvent");
    }
    for (const auto& wait : request.wait_for) STRATA_RETURN_IF_ERROR(wait->enqueue_wait(stream_));
    if (report) STRATA_CUDA_RETURN(cudaEventRecord(start.get(), stream_), "cudaEventRecord");
    if (request.src == nullptr) {
      STRATA_CUDA_RETURN(cudaMemsetAsync(request.dst, 0, request.bytes, stream_),
                         "cudaMemsetAsync");
    } else {
      STRATA_CUDA_RETURN(
          cudaMemcpyAsync(request.dst, request.src, request.bytes, cudaMemcpyDefault, stream_),
          "cudaMemcpyAsync");
    }
    STRATA_CUDA_RETURN(cudaEventRecord(end.get(), stream_), "cudaEventRecord");
    if (fence != nullptr) *fence = std::make_shared<CudaFence>(device_, end);
    if (report) {
      pending_.push_back(Pending{std::move(request), std::move(start), std::move(end)});
      cv_.notify_one();
    }
    return Status::ok();
  }

  // Everything submitted is already on the stream and cannot be recalled: wait for all of it.
  std::size_t shutdown() {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return 0;
      stopping_ = true;
    }
    cv_.notify_all();
    if (completer_.joinable()) completer_.join();
    if (stream_ != nullptr) {
      DeviceGuard guard(device_);
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
    }
    return 0;
  }

 private:
  struct Pending {
    CopyRequest request;
    EventRef start;
    EventRef end;
  };

  void run() {
    cudaSetDevice(device_);
    for (;;) {
      Pending job;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (pending_.empty()) return;
        job = std::move(pending_.front());
        pending_.pop_front();
      }
      CopyResult result;
      cudaError_t err = cudaEventSynchronize(job.end.get());
      if (err != cudaSuccess) {
        result.status = cuda_error(err, "asynchronous copy");
      } else {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, job.start.get(), job.end.get()) == cudaSuccess) {
          result.busy_ns = static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
        }
      }
      if (job.request.on_complete) job.request.on_complete(std::move(result));
    }
  }

  int device_;
  std::shared_ptr<EventPool> pool_;
  cudaStream_t stream_ = nullptr;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  bool stopping_ = false;
  std::thread completer_;
};

class CudaBackend final : public DeviceBackend {
 public:
  CudaBackend(int device, DeviceDescription description)
      : device_(device),
        description_(std::move(description)),
        pool_(std::make_shared<EventPool>(device)) {
    for (auto& q : queues_) q = std::make_unique<CudaCopyQueue>(device_, pool_);
  }
  ~CudaBackend() override { shutdown(); }

  Status start() {
    DeviceGuard guard(device_);
    STRATA_CUDA_RETURN(cudaStreamCreateWithFlags(&sync_stream_, cudaStreamNonBlocking),
                       "cudaStreamCreateWithFlags");
    for (auto& q : queues_) STRATA_RETURN_IF_ERROR(q->start());
    return Status::ok();
  }

  const DeviceDescription& description() const override { return description_; }

  Status allocate_device(uint64_t bytes, void** out) override {
    DeviceGuard guard(device_);
    cudaError_t err = cudaMalloc(out, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      return error(Code::kOutOfMemory, "cuda backend: cudaMalloc of ", bytes,
                   " bytes for the hbm tier failed (", cudaGetErrorName(err), "); ", free, " of ",
                   total, " bytes free on the device");
    }
    return Status::ok();
  }
  void free_device(void* ptr, uint64_t /*bytes*/) override {
    DeviceGuard guard(device_);
    cudaFree(ptr);
  }

  // Pins the runtime's DRAM arena once, at start-up.
  Status pin_host(void* ptr, uint64_t bytes) override {
    DeviceGuard guard(device_);
    cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return error(Code::kOutOfMemory, "cuda backend: cudaHostRegister of ", bytes,
                   " bytes for the dram tier failed: ", cudaGetErrorName(err), " (",
                   cudaGetErrorString(err), ")");
    }
    return Status::ok();
  }
  void unpin_host(void* ptr, uint64_t /*bytes*/) override {
    DeviceGuard guard(device_);
    cudaHostUnregister(ptr);
  }

  Status submit_copy(CopyRequest request, std::shared_ptr<DeviceFence>* fence) override {
    return queues_[static_cast<int>(request.direction)]->submit(std::move(request), fence);
  }

  Status copy_sync(void* dst, const void* src, uint64_t bytes) override {
    DeviceGuard guard(device_);
    std::lock_guard lock(sync_mutex_);
    STRATA_CUDA_RETURN(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, sync_stream_),
                       "cudaMemcpyAsync");
    STRATA_CUDA_RETURN(cudaStreamSynchronize(sync_stream_), "cudaStreamSynchronize");
    return Status::ok();
  }

  Status record_fence(void* stream, std::shared_ptr<DeviceFence>* out) override {
    DeviceGuard guard(device_);
    EventRef event;
    STRATA_RETURN_IF_ERROR(pool_->acquire(&event));
    STRATA_CUDA_RETURN(cudaEventRecord(event.get(), static_cast<cudaStream_t>(stream)),
                       "cudaEventRecord on the caller's stream");
    *out = std::make_shared<CudaFence>(device_, std::move(event));
    return Status::ok();
  }

  std::size_t shutdown() override {
    for (auto& q : queues_) q->shutdown();
    if (sync_stream_ != nullptr) {
      DeviceGuard guard(device_);
      cudaStreamDestroy(sync_stream_);
      sync_stream_ = nullptr;
    }
    return 0;
  }

 private:
  int device_;
  DeviceDescription description_;
  std::shared_ptr<EventPool> pool_;
  std::array<std::unique_ptr<CudaCopyQueue>, kCopyDirectionCount> queues_;
  std::mutex sync_mutex_;
  cudaStream_t sync_stream_ = nullptr;
};

}  // namespace

Status create_cuda_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out) {
  if (options.host_link_bytes_per_second != 0) {
    return error(Code::kInvalidArgument,
                 "cuda backend: host_link_bytes_per_second applies to the host backend only");
  }
  if (options.copy_fault) {
    return error(Code::kInvalidArgument,
                 "cuda backend: copy_fault applies to the host backend only");
  }
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return error(Code::kNoDevice, "no usable CUDA device: cudaGetDeviceCount returned ",
                 cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  }
  if (count == 0) return error(Code::kNoDevice, "no CUDA device present");
  if (options.ordinal < 0 || options.ordinal >= count) {
    return error(Code::kInvalidArgument, "device_ordinal ", options.ordinal,
                 " out of range: ", count, " CUDA device(s) present");
  }
  DeviceDescription d;
  d.kind = DeviceKind::kCuda;
  d.ordinal = options.ordinal;
  {
    DeviceGuard guard(options.ordinal);
    cudaDeviceProp prop{};
    STRATA_CUDA_RETURN(cudaGetDeviceProperties(&prop, options.ordinal), "cudaGetDeviceProperties");
    d.name = prop.name;
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, options.ordinal) == cudaSuccess) d.pci_bus_id = bus;
    size_t free = 0, total = 0;
    STRATA_CUDA_RETURN(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    d.free_memory = free;
    d.total_memory = total;
  }
  auto backend = std::make_shared<CudaBackend>(options.ordinal, std::move(d));
  STRATA_RETURN_IF_ERROR(backend->start());
  *out = std::move(backend);
  return Status::ok();
}

}  // namespace strata
