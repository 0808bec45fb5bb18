// StorageEngine: asynchronous reads and writes on the NVMe tier's files. Two engines share this
// interface and its semantics: io_uring (O_DIRECT, fixed files, registered buffers, batched
// submission, one completion thread) and a POSIX pread/pwrite thread pool for hosts that refuse
// io_uring. Both resume short transfers to completion, cap requests in flight at the queue
// depth, and turn errno into a status naming the path, the offset and the errno.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace strata {

enum class IoOp : int { kRead = 0, kWrite = 1 };
enum class IoEngineKind : int32_t { kAuto = 0, kUring = 1, kPosix = 2 };

// A test hook that sees every completed system-call-level transfer and may replace its result
// (bytes done, or -errno): how tests inject short reads, EIO and ENOSPC. Not for production use.
using IoFaultHook =
    std::function<int64_t(IoOp op, int file, uint64_t offset, uint64_t len, int64_t result)>;

// Called when a request finished successfully, with its bytes and the time it was in flight.
using IoRequestHook = std::function<void(IoOp op, uint64_t bytes, uint64_t in_flight_ns)>;

struct IoRequest {
  IoOp op = IoOp::kRead;
  int file = 0;                  // index into the engine's files
  uint64_t offset = 0;           // byte offset in that file; 4 KiB aligned
  unsigned char* buf = nullptr;  // 4 KiB aligned
  uint64_t len = 0;              // 4 KiB multiple
  // Called exactly once, from an engine thread, when the request finished or failed.
  std::function<void(Status)> done;
  int64_t submitted_ns = 0;  // set by the engine
};

struct StorageFile {
  std::string path;
  int fd = -1;
};

struct IoCounters {
  uint64_t bytes = 0;
  uint64_t requests = 0;
  uint64_t busy_ns = 0;  // time with at least one request of that kind in flight
};

struct StorageEngineOptions {
  unsigned queue_depth = 32;
  // Memory ranges to register as fixed buffers (io_uring only); others still work, unregistered.
  std::vector<std::pair<void*, uint64_t>> buffers;
  IoFaultHook fault_hook;
  IoRequestHook on_request;  // tracing; may be empty
};

class StorageEngine {
 public:
  virtual ~StorageEngine() = default;
  virtual const char* name() const = 0;
  // Queue a request. On success `done` will run exactly once; on failure it never runs.
  virtual Status submit(IoRequest request) = 0;
  // Finish what is in flight, fail what is queued with kCancelled, stop the threads. Idempotent.
  virtual void shutdown() = 0;

  IoCounters counters(IoOp op);
  void reset_counters();

 protected:
  StorageEngine(std::vector<StorageFile> files, StorageEngineOptions options)
      : files_(std::move(files)), options_(std::move(options)) {}

  // Bookkeeping every engine shares. `begin` when a request goes in flight, `end` when it leaves.
  void begin_request(IoRequest& request);
  void end_request(const IoRequest& request, bool ok);
  // Applies the fault hook to one transfer's result.
  int64_t filter_result(const IoRequest& r, uint64_t done, int64_t result) const;
  // Advances a request by one transfer's result. Returns true when it is finished (with *status
  // set); false when `done` grew and the rest must be submitted again (a short transfer).
  bool advance(const IoRequest& r, uint64_t* done, int64_t result, Status* status) const;

  std::vector<StorageFile> files_;
  StorageEngineOptions options_;

 private:
  std::mutex counters_mutex_;
  IoCounters counters_[2];
  int in_flight_[2] = {0, 0};
  int64_t busy_since_ns_[2] = {0, 0};
};

// Creates the engine `kind` asks for. kAuto tries io_uring and falls back to POSIX when the
// kernel refuses it; *reason says which engine runs and why.
Status create_storage_engine(IoEngineKind kind, std::vector<StorageFile> files,
                             StorageEngineOptions options, std::unique_ptr<StorageEngine>* out,
                             std::string* reason);

Status create_uring_engine(std::vector<StorageFile> files, StorageEngineOptions options,
                           std::unique_ptr<StorageEngine>* out, std::string* note);
Status create_posix_engine(std::vector<StorageFile> files, StorageEngineOptions options,
                           std::unique_ptr<StorageEngine>* out);

}  // namespace strata
