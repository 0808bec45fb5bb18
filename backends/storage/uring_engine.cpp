// The io_uring engine: one ring with the tier's files registered (fixed files) and the DRAM and
// staging arenas registered as fixed buffers, so the kernel neither looks up the file nor pins
// the pages on every request. Submitters prepare SQEs under a lock and submit in the same call
// (a batch is one io_uring_submit); one completion thread reaps CQEs, resumes short transfers,
// refills from the overflow queue, and runs the callbacks outside the lock.
#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>

#include "backends/storage/storage_engine.h"
#include "common/spawn.h"

namespace strata {
namespace {

// The kernel caps one registered buffer at 1 GiB.
constexpr uint64_t kMaxRegisteredBuffer = 1ull << 30;

struct Op {
  IoRequest request;
  uint64_t done = 0;
};

class UringEngine final : public StorageEngine {
 public:
  UringEngine(std::vector<StorageFile> files, StorageEngineOptions options)
      : StorageEngine(std::move(files), std::move(options)) {}
  ~UringEngine() override {
    shutdown();
    if (ring_ready_) io_uring_queue_exit(&ring_);
  }

  Status start(std::string* note) {
    const unsigned depth = std::max(1u, options_.queue_depth);
    // One spare entry for the shutdown NOP.
    int rc = io_uring_queue_init(depth + 1, &ring_, 0);
    if (rc < 0) {
      return error(Code::kUnsupported,
                   "io_uring refused by the kernel: io_uring_queue_init: ", std::strerror(-rc),
                   " (errno ", -rc, "; see the kernel.io_uring_disabled sysctl and seccomp)");
    }
    ring_ready_ = true;
    std::vector<int> fds;
    for (const auto& f : files_) fds.push_back(f.fd);
    rc = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
    if (rc < 0) {
      return error(Code::kUnsupported, "io_uring_register_files failed: ", std::strerror(-rc));
    }
    for (const auto& [ptr, bytes] : options_.buffers) {
      for (uint64_t off = 0; off < bytes; off += kMaxRegisteredBuffer) {
        iovecs_.push_back(iovec{static_cast<unsigned char*>(ptr) + off,
                                std::min(kMaxRegisteredBuffer, bytes - off)});
      }
    }
    if (!iovecs_.empty()) {
      rc = io_uring_register_buffers(&ring_, iovecs_.data(), static_cast<unsigned>(iovecs_.size()));
      if (rc < 0) {
        // Typically RLIMIT_MEMLOCK for an unprivileged user: still correct, a little slower.
        *note = std::string("; fixed buffers not registered (") + std::strerror(-rc) + ")";
        iovecs_.clear();
      } else {
        *note = "; " + std::to_string(iovecs_.size()) + " fixed buffer(s) registered";
      }
    }
    depth_ = depth;
    // A refused thread is OUT_OF_MEMORY (not UNSUPPORTED: kAuto must not fall back on it).
    return spawn_thread(
        "an io_uring completion", [this] { reap(); }, &reaper_);
  }

  const char* name() const override { return "io_uring"; }

  Status submit(IoRequest request) override {
    auto* op = new Op{std::move(request), 0};
    std::lock_guard lock(sq_mutex_);
    if (stopping_) {
      delete op;
      return error(Code::kInvalidState, "storage engine is shut down");
    }
    begin_request(op->request);
    if (in_flight_ >= depth_) {
      overflow_.push_back(op);
      return Status::ok();
    }
    queue_locked(op);
    io_uring_submit(&ring_);
    return Status::ok();
  }

  void shutdown() override {
    std::deque<Op*> cancelled;
    {
      std::lock_guard lock(sq_mutex_);
      if (stopping_ || !reaper_.joinable()) {
        stopping_ = true;
        return;
      }
      stopping_ = true;
      cancelled.swap(overflow_);
    }
    for (Op* op : cancelled)
      finish(op, error(Code::kCancelled, "storage request cancelled: the runtime was destroyed"));
    {
      std::unique_lock lock(sq_mutex_);
      drained_cv_.wait(lock, [&] { return in_flight_ == 0; });
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, nullptr);  // the stop sentinel
      io_uring_submit(&ring_);
    }
    reaper_.join();
  }

 private:
  int buffer_index(const unsigned char* buf, uint64_t len) const {
    for (std::size_t i = 0; i < iovecs_.size(); ++i) {
      const auto* base = static_cast<const unsigned char*>(iovecs_[i].iov_base);
      if (buf >= base && buf + len <= base + iovecs_[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }

  // Prepares the SQE for the rest of `op` (under sq_mutex_; the caller submits).
  void queue_locked(Op* op) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // cannot happen with in_flight_ <= depth_, but never write NULL
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    IoRequest& r = op->request;
    unsigned char* buf = r.buf + op->done;
    const auto len = static_cast<unsigned>(r.len - op->done);
    const uint64_t offset = r.offset + op->done;
    const int index = buffer_index(buf, len);
    if (r.op == IoOp::kRead) {
      if (index >= 0) {
        io_uring_prep_read_fixed(sqe, r.file, buf, len, offset, index);
      } else {
        io_uring_prep_read(sqe, r.file, buf, len, offset);
      }
    } else {
      if (index >= 0) {
        io_uring_prep_write_fixed(sqe, r.file, buf, len, offset, index);
      } else {
        io_uring_prep_write(sqe, r.file, buf, len, offset);
      }
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op);
    ++in_flight_;
  }

  void finish(Op* op, Status status) {
    end_request(op->request, status.is_ok());
    auto done = std::move(op->request.done);
    delete op;
    done(std::move(status));
  }

  void reap() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) return;  // the ring is broken: nothing more can complete
      std::vector<std::pair<Op*, Status>> finished;
      bool stop = false;
      {
        std::lock_guard lock(sq_mutex_);
        unsigned head;
        unsigned seen = 0;
        bool resubmit = false;
        io_uring_for_each_cqe(&ring_, head, cqe) {
          ++seen;
          auto* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
          if (op == nullptr) {
            stop = true;
            continue;
          }
          --in_flight_;
          const int64_t result = filter_result(op->request, op->done, cqe->res);
          Status status;
          if (advance(op->request, &op->done, result, &status)) {
            finished.emplace_back(op, std::move(status));
          } else {
            queue_locked(op);  // short transfer: the rest goes straight back in
            resubmit = true;
          }
        }
        io_uring_cq_advance(&ring_, seen);
        while (in_flight_ < depth_ && !overflow_.empty()) {
          queue_locked(overflow_.front());
          overflow_.pop_front();
          resubmit = true;
        }
        if (resubmit) io_uring_submit(&ring_);
      }
      for (auto& [op, status] : finished) finish(op, std::move(status));
      {
        std::lock_guard lock(sq_mutex_);
        if (in_flight_ == 0) drained_cv_.notify_all();
      }
      if (stop) return;
    }
  }

  io_uring ring_{};
  bool ring_ready_ = false;
  unsigned depth_ = 1;
  std::vector<iovec> iovecs_;
  std::mutex sq_mutex_;
  std::condition_variable drained_cv_;
  unsigned in_flight_ = 0;
  std::deque<Op*> overflow_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace

Status create_uring_engine(std::vector<StorageFile> files, StorageEngineOptions options,
                           std::unique_ptr<StorageEngine>* out, std::string* note) {
  auto engine = std::make_unique<UringEngine>(std::move(files), std::move(options));
  STRATA_RETURN_IF_ERROR(engine->start(note));
  *out = std::move(engine);
  return Status::ok();
}

}  // namespace strata
