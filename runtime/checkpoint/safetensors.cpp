#include "runtime/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <new>
#include <set>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/hex.h"
#include "common/json.h"

namespace strata::safetensors {

namespace {

// A plain (tree-backed) json: ordered_json's linear key lookup made parsing a header of n keys
// take O(n^2) time. The header's key order, which breaks ties between 0-byte tensors sharing an
// offset, is recorded while parsing instead (parse_json).
using Json = nlohmann::json;

// The reference implementation's cap; it keeps a corrupt length from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr uint64_t kLengthBytes = 8;
// Caps on what a header may declare, so that a hostile one costs bounded time and memory: a
// tensor's entry is nested 3 deep (root, entry, shape), and nothing needs more.
constexpr int kMaxDepth = 3;
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kCrcPrefix = "crc32c.";
// Not hex, so a header whose placeholders were never replaced is rejected even if a torn write
// left its length prefix in place.
constexpr std::string_view kCrcPlaceholder = "--------";
constexpr std::array<std::string_view, kDTypeCount> kCodes = {"F32", "F16", "BF16", "F64", "I8",
                                                              "U8",  "I16", "I32",  "I64", "BOOL"};

Status os_error(const std::string& path, const char* what, int err) {
  return error(Code::kIo, "safetensors file ", path, ": ", what, " failed: ", std::strerror(err),
               " (errno ", err, ")");
}

template <typename... Args>
Status malformed(const std::string& path, const Args&... what) {
  return error(Code::kInvalidArgument, "not a safetensors file: ", path, ": ", what...);
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

// Bytes of a tensor of this shape; false on overflow.
bool tensor_bytes(const std::vector<int64_t>& shape, DType dtype, uint64_t* out) {
  uint64_t bytes = dtype_size(dtype);
  for (const int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) return false;
  }
  *out = bytes;
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i > 0 ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool parse_hex8(std::string_view s, uint32_t* out) {
  if (s.size() != 8) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 16);
  return ec == std::errc() && end == s.data() + s.size();
}

// The JSON of a header, unpadded, written out directly in one pass (linear in the tensors).
// Without crcs the checksums are placeholders of the same length, so the final header fits
// exactly where the first one was written. Throws on invalid UTF-8.
std::string header_json(const std::vector<TensorInfo>& tensors,
                        const std::map<std::string, std::string>& metadata,
                        const std::vector<uint32_t>* crcs) {
  std::map<std::string, std::string> all = metadata;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    all[crc_metadata_key(tensors[i].name)] =
        crcs != nullptr ? hex8((*crcs)[i]) : std::string(kCrcPlaceholder);
  }
  std::string out = "{";
  if (!all.empty()) {
    out += json_string(kMetadataKey, JsonUtf8::kStrict) + ":{";
    bool first = true;
    for (const auto& [key, value] : all) {
      if (!first) out += ',';
      first = false;
      out += json_string(key, JsonUtf8::kStrict) + ':' + json_string(value, JsonUtf8::kStrict);
    }
    out += '}';
  }
  for (const TensorInfo& t : tensors) {
    if (out.size() > 1) out += ',';
    out += json_string(t.name, JsonUtf8::kStrict) +
           ":{\"dtype\":" + json_string(dtype_code(t.dtype), JsonUtf8::kStrict) + ",\"shape\":[";
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (d > 0) out += ',';
      out += std::to_string(t.shape[d]);
    }
    out += "],\"data_offsets\":[" + std::to_string(t.begin) + ',' + std::to_string(t.end) + "]}";
  }
  out += '}';
  return out;
}

// The first pass over a header: a SAX scan (no tree) that refuses duplicate keys at any level
// (nlohmann would silently keep the last one, which could hide a tensor), nesting deeper than a
// header needs, and more than max_entries tensors, and records the root's keys in the text's
// order. Only a header that passes is parsed into a tree. Both passes are linear in the text
// (nlohmann's parse *callback* is not: it rescans the parent object at every object's end).
class HeaderScan final : public nlohmann::json_sax<Json> {
 public:
  HeaderScan(std::size_t max_entries, std::vector<std::string>* order)
      : max_entries_(max_entries), order_(order) {}
  std::string refused;  // why the scan stopped (empty: a JSON syntax error, or none)

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return enter();
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool key(string_t& key) override {
    if (!keys_.back().insert(key).second) return refuse("it has the key \"" + key + "\" twice");
    if (depth_ == 1) {
      in_metadata_ = key == kMetadataKey;
      if (!in_metadata_ && ++tensors_ > max_entries_) {
        return refuse("it declares more than " + std::to_string(max_entries_) + " tensors");
      }
      order_->push_back(key);
    } else if (depth_ == 2 && in_metadata_ && ++metadata_entries_ > max_entries_ + 1024) {
      // A checksum per tensor, and a few entries of the writer's own.
      return refuse("its metadata has more than " + std::to_string(max_entries_ + 1024) +
                    " entries");
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    syntax_ = e.what();
    return false;
  }
  const std::string& syntax_error() const { return syntax_; }

 private:
  bool enter() {
    // The root is depth 1; a tensor's shape array is depth 3.
    if (++depth_ > kMaxDepth) {
      return refuse("it nests deeper than " + std::to_string(kMaxDepth) +
                    " levels (a safetensors header needs 3)");
    }
    return true;
  }
  bool refuse(std::string why) {
    refused = std::move(why);
    return false;
  }
  std::size_t max_entries_;
  std::vector<std::string>* order_;
  std::vector<std::set<std::string>> keys_;  // one set per open object
  int depth_ = 0;
  bool in_metadata_ = false;
  std::size_t tensors_ = 0, metadata_entries_ = 0;
  std::string syntax_;
};

Status parse_json(const std::string& path, const std::string& text, Json* out,
                  std::vector<std::string>* order, std::size_t max_entries) {
  HeaderScan scan(max_entries, order);
  if (!Json::sax_parse(text, &scan)) {
    if (!scan.refused.empty()) return malformed(path, "the header is refused: ", scan.refused);
    return malformed(path, "the header is not valid JSON: ", scan.syntax_error());
  }
  try {
    *out = Json::parse(text);
  } catch (const Json::exception& e) {
    return malformed(path, "the header is not valid JSON: ", e.what());
  }
  return Status::ok();
}

Status parse_tensor(const std::string& path, const std::string& name, const Json& value,
                    TensorInfo* out) {
  auto bad = [&](const auto&... what) {
    return malformed(path, "tensor \"", name, "\": ", what...);
  };
  if (!value.is_object()) return bad("its entry is not an object");
  const auto dtype = value.find("dtype");
  const auto shape = value.find("shape");
  const auto offsets = value.find("data_offsets");
  if (dtype == value.end() || !dtype->is_string())
    return bad("\"dtype\" is missing or not a string");
  if (shape == value.end() || !shape->is_array())
    return bad("\"shape\" is missing or not an array");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned()) {
    return bad("\"data_offsets\" is missing or not two non-negative integers");
  }
  TensorInfo t;
  t.name = name;
  const Status s = parse_dtype(dtype->get_ref<const std::string&>(), &t.dtype);
  if (!s.is_ok()) return bad(s.message());
  for (const Json& dim : *shape) {
    if (!dim.is_number_unsigned() ||
        dim.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return bad("shape ", shape->dump(), " is not a list of non-negative integers");
    }
    t.shape.push_back(static_cast<int64_t>(dim.get<uint64_t>()));
  }
  t.begin = (*offsets)[0].get<uint64_t>();
  t.end = (*offsets)[1].get<uint64_t>();
  if (t.begin > t.end)
    return bad("data_offsets [", t.begin, ", ", t.end, "] end before they begin");
  uint64_t bytes = 0;
  if (!tensor_bytes(t.shape, t.dtype, &bytes)) {
    return bad("shape ", shape_string(t.shape), " overflows 64 bits");
  }
  if (bytes != t.end - t.begin) {
    return bad("shape ", shape_string(t.shape), " of ", dtype_code(t.dtype), " needs ", bytes,
               " bytes but data_offsets [", t.begin, ", ", t.end, "] hold ", t.end - t.begin);
  }
  *out = std::move(t);
  return Status::ok();
}

// Checks that the tensors, sorted by offset, tile the data section exactly.
Status check_layout(const std::string& path, const std::vector<TensorInfo>& tensors,
                    uint64_t data_bytes) {
  uint64_t expected = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin < expected) {
      return malformed(path, "tensor \"", t.name, "\" at [", t.begin, ", ", t.end,
                       ") overlaps tensor \"", previous->name, "\" at [", previous->begin, ", ",
                       previous->end, ")");
    }
    if (t.begin > expected) {
      return malformed(path, "the ", t.begin - expected, " bytes at [", expected, ", ", t.begin,
                       ") before tensor \"", t.name, "\" belong to no tensor");
    }
    expected = t.end;
    previous = &t;
  }
  if (expected > data_bytes) {
    return malformed(path, "the file is truncated: tensor \"", previous->name, "\" ends at ",
                     expected, " but the data section has only ", data_bytes, " bytes");
  }
  if (expected < data_bytes) {
    return malformed(path, "the ", data_bytes - expected, " bytes after the last tensor's end (",
                     expected, ") belong to no tensor");
  }
  return Status::ok();
}

Status parse_header(const std::string& path, const std::string& text, uint64_t data_bytes,
                    std::size_t max_entries, Header* header, std::vector<int64_t>* crcs) {
  Json root;
  std::vector<std::string> order;
  STRATA_RETURN_IF_ERROR(parse_json(path, text, &root, &order, max_entries));
  if (!root.is_object()) return malformed(path, "the header is not a JSON object");
  header->tensors.reserve(order.size());
  for (const std::string& key : order) {  // the text's order (the tree's is sorted)
    const Json& value = root.find(key).value();
    if (key == kMetadataKey) {
      if (!value.is_object()) return malformed(path, "\"__metadata__\" is not an object");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) {
          return malformed(path, "metadata \"", m.key(), "\" is not a string");
        }
        header->metadata.emplace_hint(header->metadata.end(), m.key(),
                                      m.value().get<std::string>());
      }
      continue;
    }
    TensorInfo t;
    STRATA_RETURN_IF_ERROR(parse_tensor(path, key, value, &t));
    header->tensors.push_back(std::move(t));
  }
  std::stable_sort(header->tensors.begin(), header->tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  STRATA_RETURN_IF_ERROR(check_layout(path, header->tensors, data_bytes));
  crcs->assign(header->tensors.size(), -1);
  for (std::size_t i = 0; i < header->tensors.size(); ++i) {
    const auto m = header->metadata.find(crc_metadata_key(header->tensors[i].name));
    if (m == header->metadata.end()) continue;
    uint32_t crc = 0;
    if (!parse_hex8(m->second, &crc)) {
      return malformed(path, "metadata \"", m->first, "\" is \"", m->second,
                       "\", not 8 hex digits (was the file finished?)");
    }
    (*crcs)[i] = crc;
  }
  return Status::ok();
}

}  // namespace

std::string crc_metadata_key(std::string_view tensor_name) {
  return std::string(kCrcPrefix) + std::string(tensor_name);
}

std::string_view dtype_code(DType dtype) {
  const auto index = static_cast<int32_t>(dtype);
  return valid_dtype(index) ? kCodes[static_cast<std::size_t>(index)] : "unknown";
}

Status parse_dtype(std::string_view code, DType* out) {
  for (std::size_t i = 0; i < kCodes.size(); ++i) {
    if (kCodes[i] == code) {
      *out = static_cast<DType>(i);
      return Status::ok();
    }
  }
  return error(Code::kInvalidArgument, "dtype \"", code,
               "\" is not one Strata supports (F32, F16, BF16, F64, I8, U8, I16, I32, I64, BOOL)");
}

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
  } catch (const Json::exception&) {
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
  } catch (const Json::exception& e) {
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
