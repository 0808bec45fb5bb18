// Completion: the shared state behind a strata_event. The runtime completes it from a backend
// thread when the work ends; any number of threads may query or wait on it; it outlives the
// runtime if its owner keeps the event.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>

#include "backends/device/device_backend.h"
#include "common/status.h"

namespace strata {

class Completion {
 public:
  // An already finished completion (a move to the tier the tensor is in).
  static std::shared_ptr<Completion> finished(Status status) {
    auto c = std::make_shared<Completion>();
    c->complete(std::move(status));
    return c;
  }

  // The device-side marker of the work, for enqueue_wait(); set once, after submission.
  void set_fence(std::shared_ptr<DeviceFence> fence) {
    std::lock_guard lock(mutex_);
    if (!done_) fence_ = std::move(fence);
  }

  void complete(Status status) {
    {
      std::lock_guard lock(mutex_);
      status_ = std::move(status);
      done_ = true;
      fence_.reset();  // nothing needs to wait on the device any more
    }
    cv_.notify_all();
  }

  // kNotReady while running, else the work's status.
  Status query() const {
    std::lock_guard lock(mutex_);
    return done_ ? status_ : Status(Code::kNotReady, "");
  }

  // Timeouts of this many milliseconds (about 100 years) or more wait without limit: the
  // deadline in nanoseconds would overflow steady_clock's 64-bit count (INT64_MAX ms did).
  static constexpr int64_t kUnboundedMs = 100ll * 365 * 24 * 3600 * 1000;

  // timeout_ms < 0 (or >= kUnboundedMs) waits without limit.
  Status wait(int64_t timeout_ms) const {
    std::unique_lock lock(mutex_);
    auto finished = [&] { return done_; };
    if (timeout_ms < 0 || timeout_ms >= kUnboundedMs) {
      cv_.wait(lock, finished);
    } else if (!cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), finished)) {
      return error(Code::kTimeout, "event not complete after ", timeout_ms, " ms");
    }
    return status_;
  }

  // Make `stream` wait for the work; immediate if it already finished.
  Status enqueue_wait(void* stream) const {
    std::shared_ptr<DeviceFence> fence;
    {
      std::lock_guard lock(mutex_);
      if (done_) return status_;
      fence = fence_;
    }
    if (fence == nullptr) return wait(-1);  // submitted but fence not yet attached: rare, brief
    return fence->enqueue_wait(stream);
  }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  Status status_;
  std::shared_ptr<DeviceFence> fence_;
};

// A fence over a Completion: for work that finishes on a host thread (an NVMe transfer), so
// streams can only be made to wait by blocking the calling thread.
class CompletionFence final : public DeviceFence {
 public:
  explicit CompletionFence(std::shared_ptr<Completion> completion)
      : completion_(std::move(completion)) {}
  Status enqueue_wait(void* /*stream*/) override { return completion_->wait(-1); }
  Status host_wait() override { return completion_->wait(-1); }
  bool is_done() const override { return completion_->query().code() != Code::kNotReady; }
  Status elapsed_since(const DeviceFence& /*earlier*/, uint64_t* ns) const override {
    *ns = 0;  // host-side work: no device timeline to measure on
    return Status::ok();
  }

 private:
  std::shared_ptr<Completion> completion_;
};

}  // namespace strata
