#include "backends/storage/storage_engine.h"

#include <cstring>

#include "common/clock.h"

namespace strata {
IoCounters StorageEngine::counters(IoOp op) {
  std::lock_guard lock(counters_mutex_);
  IoCounters c = counters_[static_cast<int>(op)];
  if (in_flight_[static_cast<int>(op)] > 0) {
    c.busy_ns += static_cast<uint64_t>(steady_ns() - busy_since_ns_[static_cast<int>(op)]);
  }
  return c;
}

void StorageEngine::reset_counters() {
  std::lock_guard lock(counters_mutex_);
  for (int i = 0; i < 2; ++i) {
    counters_[i] = IoCounters{};
    busy_since_ns_[i] = steady_ns();
  }
}

void StorageEngine::begin_request(IoRequest& request) {
  const int64_t now = steady_ns();
  request.submitted_ns = now;
  std::lock_guard lock(counters_mutex_);
  const int i = static_cast<int>(request.op);
  if (in_flight_[i]++ == 0) busy_since_ns_[i] = now;
}

void StorageEngine::end_request(const IoRequest& request, bool ok) {
  const int64_t now = steady_ns();
  {
    std::lock_guard lock(counters_mutex_);
    const int i = static_cast<int>(request.op);
    if (ok) {
      counters_[i].bytes += request.len;
      counters_[i].requests += 1;
    }
    if (--in_flight_[i] == 0)
      counters_[i].busy_ns += static_cast<uint64_t>(now - busy_since_ns_[i]);
  }
  if (ok && options_.on_request) {
    options_.on_request(request.op, request.len, static_cast<uint64_t>(now - request.submitted_ns));
  }
}

int64_t StorageEngine::filter_result(const IoRequest& r, uint64_t done, int64_t result) const {
  if (!options_.fault_hook) return result;
  return options_.fault_hook(r.op, r.file, r.offset + done, r.len - done, result);
}

bool StorageEngine::advance(const IoRequest& r, uint64_t* done, int64_t result,
                            Status* status) const {
  const char* verb = r.op == IoOp::kRead ? "read" : "write";
  const std::string& path = files_[static_cast<std::size_t>(r.file)].path;
  if (result < 0) {
    const int err = static_cast<int>(-result);
    *status = error(Code::kIo, verb, " of ", r.len - *done, " bytes at offset ", r.offset + *done,
                    " of ", path, " failed: ", std::strerror(err), " (errno ", err, ")");
    return true;
  }
  if (result == 0) {
    *status = error(Code::kIo, verb, " at offset ", r.offset + *done, " of ", path,
                    r.op == IoOp::kRead ? " hit the end of the file" : " wrote nothing", " with ",
                    r.len - *done, " bytes to go");
    return true;
  }
  *done += static_cast<uint64_t>(result);
  if (*done >= r.len) {
    *status = Status::ok();
    return true;
  }
  // O_DIRECT needs every piece aligned; a short transfer that broke alignment cannot resume.
  if (*done % 512 != 0) {
    *status = error(Code::kIo, verb, " at offset ", r.offset, " of ", path, " stopped after ",
                    *done, " bytes, not a multiple of 512: cannot resume with O_DIRECT");
    return true;
  }
  return false;
}

Status create_storage_engine(IoEngineKind kind, std::vector<StorageFile> files,
                             StorageEngineOptions options, std::unique_ptr<StorageEngine>* out,
                             std::string* reason) {
  switch (kind) {
    case IoEngineKind::kPosix:
      *reason = "posix: asked for by the config";
      return create_posix_engine(std::move(files), std::move(options), out);
    case IoEngineKind::kUring: {
      std::string note;
      STRATA_RETURN_IF_ERROR(create_uring_engine(std::move(files), std::move(options), out, &note));
      *reason = "io_uring: asked for by the config" + note;
      return Status::ok();
    }
    case IoEngineKind::kAuto: {
      std::string note;
      Status uring = create_uring_engine(files, options, out, &note);
      if (uring.is_ok()) {
        *reason = "io_uring: available" + note;
        return uring;
      }
      if (uring.code() != Code::kUnsupported) return uring;
      *reason = "posix: " + uring.message();
      return create_posix_engine(std::move(files), std::move(options), out);
    }
  }
  return error(Code::kInvalidArgument, "unknown io_engine ", static_cast<int32_t>(kind));
}

}  // namespace strata
