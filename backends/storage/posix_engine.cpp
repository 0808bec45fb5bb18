// The POSIX engine: pread/pwrite on a pool of threads, for hosts that refuse io_uring (the
// kernel.io_uring_disabled sysctl, seccomp, an old kernel). Same semantics as io_uring: at most
// queue_depth requests in flight, short transfers resumed, errors as statuses with path and
// errno. One thread per request in flight is the only way to have that many in flight with
// blocking calls.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "backends/storage/storage_engine.h"
#include "common/spawn.h"

namespace strata {
namespace {

class PosixEngine final : public StorageEngine {
 public:
  PosixEngine(std::vector<StorageFile> files, StorageEngineOptions options)
      : StorageEngine(std::move(files), std::move(options)) {}
  ~PosixEngine() override { shutdown(); }

  // Starts the pool. A thread the OS refuses is OUT_OF_MEMORY naming it; the destructor stops
  // the threads that did start (a throwing constructor would have destroyed them joinable).
  Status start() {
    const unsigned threads = std::clamp(options_.queue_depth, 1u, 64u);
    for (unsigned i = 0; i < threads; ++i) {
      std::thread t;
      STRATA_RETURN_IF_ERROR(spawn_thread(
          "a posix storage engine", [this] { run(); }, &t));
      workers_.push_back(std::move(t));
    }
    return Status::ok();
  }

  const char* name() const override { return "posix"; }

  Status submit(IoRequest request) override {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return error(Code::kInvalidState, "storage engine is shut down");
      begin_request(request);
      queue_.push_back(std::move(request));
    }
    cv_.notify_one();
    return Status::ok();
  }

  void shutdown() override {
    std::deque<IoRequest> cancelled;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
      cancelled.swap(queue_);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    for (auto& r : cancelled) {
      end_request(r, false);
      r.done(error(Code::kCancelled, "storage request cancelled: the runtime was destroyed"));
    }
  }

 private:
  void run() {
    for (;;) {
      IoRequest r;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;  // what is still queued is cancelled by shutdown()
        r = std::move(queue_.front());
        queue_.pop_front();
      }
      const int fd = files_[static_cast<std::size_t>(r.file)].fd;
      uint64_t done = 0;
      Status status;
      for (;;) {
        const uint64_t len = r.len - done;
        const auto offset = static_cast<off_t>(r.offset + done);
        ssize_t n = r.op == IoOp::kRead ? pread(fd, r.buf + done, len, offset)
                                        : pwrite(fd, r.buf + done, len, offset);
        if (n < 0 && errno == EINTR) continue;
        const int64_t result = filter_result(r, done, n < 0 ? -errno : n);
        if (advance(r, &done, result, &status)) break;
      }
      end_request(r, status.is_ok());
      r.done(std::move(status));
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<IoRequest> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

Status create_posix_engine(std::vector<StorageFile> files, StorageEngineOptions options,
                           std::unique_ptr<StorageEngine>* out) {
  auto engine = std::make_unique<PosixEngine>(std::move(files), std::move(options));
  STRATA_RETURN_IF_ERROR(engine->start());
  *out = std::move(engine);
  return Status::ok();
}

}  // namespace strata
