#include "backends/device/host_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "common/spawn.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Copies are done in slices so a bandwidth limit is smooth and a slow copy can be seen
// progressing; 4 MiB is also the size at which real links reach their peak
// (docs/benchmarks/native.md, strata-bench io).
constexpr uint64_t kSliceBytes = 4ull << 20;

// Completion flag of one copy, shared by the fence and the queue.
struct HostCopyState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  Clock::time_point done_at;

  void mark_done() {
    {
      std::lock_guard lock(mutex);
      done = true;
      done_at = Clock::now();
    }
    done_cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [&] { return done; });
  }
};

class HostFence final : public DeviceFence {
 public:
  explicit HostFence(std::shared_ptr<HostCopyState> state) : state_(std::move(state)) {}
  Status enqueue_wait(void* /*stream*/) override { return host_wait(); }
  Status host_wait() override {
    state_->wait();
    return Status::ok();
  }
  bool is_done() const override {
    std::lock_guard lock(state_->mutex);
    return state_->done;
  }
  Status elapsed_since(const DeviceFence& earlier, uint64_t* ns) const override {
    const auto* e = dynamic_cast<const HostFence*>(&earlier);
    if (e == nullptr) return error(Code::kInternal, "fences of different backends");
    const auto d = state_->done_at - e->state_->done_at;
    *ns = static_cast<uint64_t>(
        std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()));
    return Status::ok();
  }

 private:
  std::shared_ptr<HostCopyState> state_;
};

// One direction's in-order copy queue and its worker thread.
class CopyQueue {
 public:
  explicit CopyQueue(uint64_t bytes_per_second) : bytes_per_second_(bytes_per_second) {}
  ~CopyQueue() { shutdown(); }

  // Starts the worker. A thread the OS refuses (a pids limit) is OUT_OF_MEMORY naming it, not
  // an exception out of a constructor (which the ABI's firewall could only call INTERNAL).
  Status start() {
    return spawn_thread(
        "a host backend copy", [this] { run(); }, &worker_);
  }

  Status push(CopyRequest request, std::shared_ptr<HostCopyState> state) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return error(Code::kInvalidState, "host backend: copy queue is shut down");
      jobs_.push_back(Job{std::move(request), std::move(state)});
    }
    work_cv_.notify_one();
    return Status::ok();
  }

  // Cancel queued jobs, let the running one finish, join. Returns the number cancelled.
  std::size_t shutdown() {
    std::deque<Job> cancelled;
    {
      std::lock_guard lock(mutex_);
      if (stopping_ && !worker_.joinable()) return 0;
      stopping_ = true;
      cancelled.swap(jobs_);
    }
    work_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    for (Job& job : cancelled) {
      job.request.on_complete(
          CopyResult{error(Code::kCancelled, "copy of ", job.request.bytes,
                           " bytes cancelled: the runtime was destroyed before it started"),
                     0});
      job.state->mark_done();
    }
    return cancelled.size();
  }

 private:
  struct Job {
    CopyRequest request;
    std::shared_ptr<HostCopyState> state;
  };

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        work_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping and nothing left that already started
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      for (const auto& fence : job.request.wait_for) (void)fence->host_wait();
      const auto start = Clock::now();
      copy_throttled(job.request, start);
      const auto busy = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start);
      if (job.request.on_complete) {
        job.request.on_complete(CopyResult{Status::ok(), static_cast<uint64_t>(busy.count())});
      }
      job.state->mark_done();
    }
  }

  void copy_throttled(const CopyRequest& request, Clock::time_point start) const {
    auto* dst = static_cast<unsigned char*>(request.dst);
    const auto* src = static_cast<const unsigned char*>(request.src);
    for (uint64_t done = 0; done < request.bytes;) {
      const uint64_t n = std::min(kSliceBytes, request.bytes - done);
      if (src != nullptr) {
        std::memcpy(dst + done, src + done, n);
      } else {
        std::memset(dst + done, 0, n);
      }
      done += n;
      if (bytes_per_second_ > 0) {
        const auto due =
            start + std::chrono::nanoseconds(static_cast<int64_t>(
                        static_cast<double>(done) * 1e9 / static_cast<double>(bytes_per_second_)));
        std::this_thread::sleep_until(due);
      }
    }
  }

  const uint64_t bytes_per_second_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread worker_;
};

class HostBackend final : public DeviceBackend {
 public:
  explicit HostBackend(const DeviceOptions& options)
      : queues_{std::make_unique<CopyQueue>(options.host_link_bytes_per_second),
                std::make_unique<CopyQueue>(options.host_link_bytes_per_second)},
        copy_fault_(options.copy_fault) {
    description_.kind = DeviceKind::kHost;
    description_.ordinal = 0;
    description_.name = "host (simulated device)";
  }
  ~HostBackend() override { shutdown(); }

  // Starts both queues' workers; on failure the destructor stops the one that started.
  Status start() {
    for (auto& queue : queues_) STRATA_RETURN_IF_ERROR(queue->start());
    return Status::ok();
  }

  const DeviceDescription& description() const override { return description_; }

  // Simulated device memory is an anonymous mapping: pages are only backed once touched, so a
  // large simulated budget costs nothing until tensors use it.
  Status allocate_device(uint64_t bytes, void** out) override { return map(bytes, "hbm", out); }
  void free_device(void* ptr, uint64_t bytes) override { munmap(ptr, bytes); }
  // Host memory needs no pinning for a simulated device: the runtime already made it resident.
  Status pin_host(void* /*ptr*/, uint64_t /*bytes*/) override { return Status::ok(); }
  void unpin_host(void* /*ptr*/, uint64_t /*bytes*/) override {}

  Status submit_copy(CopyRequest request, std::shared_ptr<DeviceFence>* fence) override {
    if (copy_fault_) STRATA_RETURN_IF_ERROR(copy_fault_(request.dst, request.src, request.bytes));
    auto state = std::make_shared<HostCopyState>();
    auto& queue = *queues_[static_cast<int>(request.direction)];
    STRATA_RETURN_IF_ERROR(queue.push(std::move(request), state));
    if (fence != nullptr) *fence = std::make_shared<HostFence>(std::move(state));
    return Status::ok();
  }

  Status copy_sync(void* dst, const void* src, uint64_t bytes) override {
    if (copy_fault_) STRATA_RETURN_IF_ERROR(copy_fault_(dst, src, bytes));
    std::memcpy(dst, src, bytes);
    return Status::ok();
  }

  Status record_fence(void* /*stream*/, std::shared_ptr<DeviceFence>* out) override {
    auto state = std::make_shared<HostCopyState>();
    state->mark_done();
    *out = std::make_shared<HostFence>(std::move(state));
    return Status::ok();
  }

  std::size_t shutdown() override {
    std::size_t cancelled = 0;
    for (auto& queue : queues_) cancelled += queue->shutdown();
    return cancelled;
  }

 private:
  static Status map(uint64_t bytes, const char* tier, void** out) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      return error(Code::kOutOfMemory, "host backend: cannot map ", bytes, " bytes for the ", tier,
                   " tier: ", std::strerror(err), " (errno ", err, ")");
    }
    *out = p;
    return Status::ok();
  }

  DeviceDescription description_;
  std::array<std::unique_ptr<CopyQueue>, kCopyDirectionCount> queues_;
  const std::function<Status(const void*, const void*, uint64_t)> copy_fault_;
};

}  // namespace

Status create_host_backend(const DeviceOptions& options, std::shared_ptr<DeviceBackend>* out) {
  if (options.ordinal != 0) {
    return error(Code::kInvalidArgument, "host backend: device_ordinal must be 0, got ",
                 options.ordinal);
  }
  auto backend = std::make_shared<HostBackend>(options);
  STRATA_RETURN_IF_ERROR(backend->start());
  *out = std::move(backend);
  return Status::ok();
}

}  // namespace strata
