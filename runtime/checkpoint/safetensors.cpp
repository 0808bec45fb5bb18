// The safetensors Writer and Reader: the file's bytes streamed out and in with positional I/O,
// each tensor's CRC-32C extended as its bytes pass. The header they share is
// safetensors_header.*.
#include "runtime/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <set>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/hex.h"
#include "runtime/checkpoint/safetensors_header.h"

namespace strata::safetensors {

namespace {

Status os_error(const std::string& path, const char* what, int err) {
  return error(Code::kIo, "safetensors file ", path, ": ", what, " failed: ", std::strerror(err),
               " (errno ", err, ")");
}

Status pread_full(int fd, void* data, uint64_t bytes, uint64_t offset, const std::string& path) {
  auto* p = static_cast<unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return os_error(path, "read", errno);
    }
    if (n == 0) {
      return error(Code::kIo, "safetensors file ", path, ": unexpected end of file at offset ",
                   offset, " (was it truncated while open?)");
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

Status pwrite_full(int fd, const void* data, uint64_t bytes, uint64_t offset,
                   const std::string& path) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return os_error(path, "write", errno);
    }
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Writer

Status Writer::create(const std::string& path, std::vector<TensorInfo> tensors,
                      std::map<std::string, std::string> metadata, std::unique_ptr<Writer>* out) {
  auto invalid = [&](const auto&... what) {
    return error(Code::kInvalidArgument, "safetensors file ", path, ": ", what...);
  };
  if (tensors.size() > kMaxTensors) {
    return invalid(tensors.size(), " tensors are more than a file may hold (", kMaxTensors, ")");
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (TensorInfo& t : tensors) {
    if (t.name.empty()) return invalid("a tensor has an empty name");
    if (t.name == kMetadataKey) return invalid("\"__metadata__\" cannot name a tensor");
    if (!names.insert(t.name).second) return invalid("tensor \"", t.name, "\" is declared twice");
    if (!valid_dtype(static_cast<int32_t>(t.dtype))) {
      return invalid("tensor \"", t.name, "\" has invalid dtype ", static_cast<int32_t>(t.dtype));
    }
    uint64_t bytes = 0;
    if (!tensor_bytes(t.shape, t.dtype, &bytes) || __builtin_add_overflow(offset, bytes, &t.end)) {
      return invalid("tensor \"", t.name, "\" has shape ", shape_string(t.shape),
                     ", which is negative or too large");
    }
    t.begin = offset;
    offset = t.end;
  }
  for (const auto& [key, value] : metadata) {
    if (key.starts_with(kCrcPrefix)) {
      return invalid("metadata key \"", key, "\" is reserved for the checksums Strata writes");
    }
  }

  auto w = std::unique_ptr<Writer>(new Writer);
  w->path_ = path;
  w->tensors_ = std::move(tensors);
  w->crcs_.assign(w->tensors_.size(), 0);
  w->metadata_ = std::move(metadata);
  w->total_bytes_ = offset;
  try {
    const uint64_t json_bytes = header_json(w->tensors_, w->metadata_, nullptr).size();
    // Pad with spaces (valid JSON whitespace) so the data starts 8-byte aligned, as the
    // reference writer does: readers that map the file can then use the tensors in place.
    w->header_bytes_ = (json_bytes + 7) / 8 * 8;
  } catch (const nlohmann::json::exception&) {
    return invalid("a tensor name or metadata string is not valid UTF-8");
  }
  if (w->header_bytes_ > kMaxHeaderBytes) {
    return invalid("the header would be ", w->header_bytes_, " bytes, over the limit of ",
                   kMaxHeaderBytes);
  }

  w->fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w->fd_ < 0) return os_error(path, "create", errno);
  STRATA_RETURN_IF_ERROR(w->write_prefix(false));
  *out = std::move(w);
  return Status::ok();
}

Writer::~Writer() {
  if (fd_ >= 0) close(fd_);
}

Status Writer::fail(Status s) {
  failed_ = s;
  return s;
}

// The length prefix and the header. Unfinished, the prefix is 0: no valid file has an empty
// header, so every reader rejects the file until finish() writes the real one.
Status Writer::write_prefix(bool finished) {
  std::string json;
  try {
    json = header_json(tensors_, metadata_, finished ? &crcs_ : nullptr);
  } catch (const nlohmann::json::exception& e) {
    return error(Code::kInternal, "safetensors file ", path_, ": header: ", e.what());
  }
  if (json.size() > header_bytes_) {
    return error(Code::kInternal, "safetensors file ", path_, ": the final header (", json.size(),
                 " bytes) outgrew its placeholder (", header_bytes_, ")");
  }
  std::string prefix(kLengthBytes, '\0');
  const uint64_t length = finished ? header_bytes_ : 0;
  for (uint64_t i = 0; i < kLengthBytes; ++i) {
    prefix[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  }
  prefix += json;
  prefix.resize(kLengthBytes + header_bytes_, ' ');
  return pwrite_full(fd_, prefix.data(), prefix.size(), 0, path_);
}

Status Writer::append(const void* data, uint64_t bytes) {
  if (finished_) {
    return error(Code::kInvalidState, "safetensors file ", path_, ": append after finish()");
  }
  if (!failed_.is_ok()) return failed_;
  if (bytes > total_bytes_ - written_) {
    return error(Code::kInvalidArgument, "safetensors file ", path_, ": appending ", bytes,
                 " bytes at data offset ", written_, " exceeds the declared ", total_bytes_,
                 " bytes of data by ", bytes - (total_bytes_ - written_));
  }
  if (bytes == 0) return Status::ok();
  if (data == nullptr) {
    return error(Code::kInvalidArgument, "safetensors file ", path_, ": append of ", bytes,
                 " bytes from a null pointer");
  }
  const Status s = pwrite_full(fd_, data, bytes, kLengthBytes + header_bytes_ + written_, path_);
  if (!s.is_ok()) return fail(s);
  // Split the piece at tensor boundaries, extending each tensor's CRC with its share.
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    while (tensors_[current_].end == written_) ++current_;  // also skips 0-byte tensors
    const uint64_t n = std::min(bytes, tensors_[current_].end - written_);
    crcs_[current_] = crc32c_extend(crcs_[current_], p, n);
    p += n;
    bytes -= n;
    written_ += n;
  }
  return Status::ok();
}

Status Writer::finish() {
  if (finished_) {
    return error(Code::kInvalidState, "safetensors file ", path_, ": finish() called twice");
  }
  if (!failed_.is_ok()) return failed_;
  if (written_ < total_bytes_) {
    const auto t = std::find_if(tensors_.begin(), tensors_.end(),
                                [&](const TensorInfo& x) { return x.end > written_; });
    return error(Code::kInvalidArgument, "safetensors file ", path_, ": tensor \"", t->name,
                 "\" got ", written_ - std::min(written_, t->begin), " of its ", t->end - t->begin,
                 " bytes (", written_, " of ", total_bytes_, " data bytes appended)");
  }
  const Status s = write_prefix(true);
  if (!s.is_ok()) return fail(s);
  if (fsync(fd_) != 0) return fail(os_error(path_, "fsync", errno));
  const int rc = close(fd_);
  fd_ = -1;
  if (rc != 0) return fail(os_error(path_, "close", errno));
  finished_ = true;
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// Reader

Status Reader::open(const std::string& path, std::unique_ptr<Reader>* out,
                    std::size_t max_tensors) {
  auto r = std::unique_ptr<Reader>(new Reader);
  r->path_ = path;
  // O_NONBLOCK: opening a FIFO (or a device) for reading would otherwise block until a writer
  // appears, forever. It is refused below; on a regular file the flag changes nothing.
  r->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (r->fd_ < 0) {
    const int err = errno;
    if (err == ENOENT) return error(Code::kNotFound, "safetensors file ", path, " does not exist");
    return os_error(path, "open", err);
  }
  struct stat st {};
  if (fstat(r->fd_, &st) != 0) return os_error(path, "stat", errno);
  if (!S_ISREG(st.st_mode)) return malformed(path, "not a regular file");
  const int flags = fcntl(r->fd_, F_GETFL);
  if (flags < 0 || fcntl(r->fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return os_error(path, "fcntl", errno);
  }
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kLengthBytes) {
    return malformed(path, "the file has ", file_bytes,
                     " bytes, too few for the 8-byte header length");
  }
  unsigned char prefix[kLengthBytes];
  STRATA_RETURN_IF_ERROR(pread_full(r->fd_, prefix, kLengthBytes, 0, path));
  uint64_t header_bytes = 0;
  for (uint64_t i = 0; i < kLengthBytes; ++i) header_bytes |= uint64_t{prefix[i]} << (8 * i);
  if (header_bytes == 0) return malformed(path, "the header length is 0 (an unfinished write?)");
  if (header_bytes > kMaxHeaderBytes) {
    return malformed(path, "the header length ", header_bytes, " is over the limit of ",
                     kMaxHeaderBytes, " bytes");
  }
  if (header_bytes > file_bytes - kLengthBytes) {
    return malformed(path, "the header length ", header_bytes, " is more than the ",
                     file_bytes - kLengthBytes, " bytes that follow it");
  }
  std::string text(header_bytes, '\0');
  STRATA_RETURN_IF_ERROR(pread_full(r->fd_, text.data(), header_bytes, kLengthBytes, path));
  r->header_.data_start = kLengthBytes + header_bytes;
  STRATA_RETURN_IF_ERROR(parse_header(path, text, file_bytes - r->header_.data_start,
                                      std::min(max_tensors, kMaxTensors), &r->header_, &r->crcs_));
  for (std::size_t i = 0; i < r->header_.tensors.size(); ++i) {
    r->index_.emplace(r->header_.tensors[i].name, i);
  }
  // Tensors are read front to back in large pieces: let the kernel read ahead further.
  (void)posix_fadvise(r->fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  *out = std::move(r);
  return Status::ok();
}

Reader::~Reader() {
  if (fd_ >= 0) close(fd_);
}

bool Reader::has_checksum(const TensorInfo& tensor) const {
  const auto it = index_.find(tensor.name);
  return it != index_.end() && crcs_[it->second] >= 0;
}

const TensorInfo* Reader::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

Status Reader::read_tensor(
    const TensorInfo& tensor, uint64_t chunk_bytes,
    const std::function<Status(const void*, uint64_t, uint64_t)>& sink) const {
  const auto it = index_.find(tensor.name);
  if (it == index_.end() || header_.tensors[it->second].begin != tensor.begin ||
      header_.tensors[it->second].end != tensor.end) {
    return error(Code::kInvalidArgument, "safetensors file ", path_, " has no tensor \"",
                 tensor.name, "\" at [", tensor.begin, ", ", tensor.end, ")");
  }
  if (chunk_bytes == 0 || !sink) {
    return error(Code::kInvalidArgument, "safetensors file ", path_, ": reading tensor \"",
                 tensor.name, "\" needs a chunk size above 0 and a sink");
  }
  const int64_t stored = crcs_[it->second];
  const uint64_t bytes = tensor.end - tensor.begin;
  uint32_t crc = 0;
  if (bytes > 0) {
    const uint64_t buffer_bytes = std::min(chunk_bytes, bytes);
    std::unique_ptr<unsigned char[]> buffer(new (std::nothrow) unsigned char[buffer_bytes]);
    if (buffer == nullptr) {
      return error(Code::kOutOfMemory, "safetensors file ", path_, ": no memory for a ",
                   buffer_bytes, "-byte buffer to read tensor \"", tensor.name, "\"");
    }
    for (uint64_t offset = 0; offset < bytes;) {
      const uint64_t n = std::min(buffer_bytes, bytes - offset);
      STRATA_RETURN_IF_ERROR(
          pread_full(fd_, buffer.get(), n, header_.data_start + tensor.begin + offset, path_));
      if (stored >= 0) crc = crc32c_extend(crc, buffer.get(), n);
      STRATA_RETURN_IF_ERROR(sink(buffer.get(), offset, n));
      offset += n;
    }
  }
  if (stored >= 0 && crc != static_cast<uint32_t>(stored)) {
    return error(Code::kDataCorruption, "safetensors file ", path_, ": tensor \"", tensor.name,
                 "\" is corrupt: the CRC-32C of its ", bytes, " bytes is ", hex8(crc),
                 " but the file records ", hex8(static_cast<uint32_t>(stored)));
  }
  return Status::ok();
}

}  // namespace strata::safetensors
