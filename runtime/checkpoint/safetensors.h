// The Hugging Face safetensors format, read and written by streaming so that checkpoints of tens
// of GB never have to fit in memory. A file is an 8-byte little-endian header length N, N bytes
// of JSON (tensor name -> dtype, shape, data_offsets; plus an optional "__metadata__" object of
// strings), then the tensors' bytes. Files Strata writes carry each tensor's CRC-32C in the
// metadata ("crc32c.<name>", 8 lowercase hex digits), which the Reader checks; files from other
// writers have none and are read unchecked.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/types.h"

namespace strata::safetensors {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the start of the data section
};

struct Header {
  std::vector<TensorInfo> tensors;  // in data order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute file offset of the data section
};

// The most tensors a file may declare (and, twice that, metadata entries): the Reader refuses a
// header beyond it before parsing further, the Writer refuses to write one.
constexpr std::size_t kMaxTensors = std::size_t{1} << 20;

// The metadata key under which a tensor's CRC-32C is stored.
std::string crc_metadata_key(std::string_view tensor_name);

// "F32", "BF16", ...: the format's names for Strata's dtypes.
std::string_view dtype_code(DType dtype);
// kInvalidArgument for a name that is not one of Strata's dtypes (the format has more, such as
// U16 or F8_E4M3, which Strata cannot hold).
Status parse_dtype(std::string_view code, DType* out);

// Streams a new file: the tensors' bytes are appended in the declared order and written straight
// from the caller's buffers, so append large pieces. The header is written by create() with
// placeholders of the final length and rewritten by finish(); until then its length prefix is 0,
// so no reader accepts an unfinished file (a Writer destroyed without finish(), a crash).
// Callers write to a temporary path and rename it once finish() succeeds.
class Writer {
 public:
  // Creates (or truncates) `path`. The tensors' begin/end are ignored and computed; names must
  // be unique and non-empty, and metadata keys starting with "crc32c." are reserved.
  static Status create(const std::string& path, std::vector<TensorInfo> tensors,
                       std::map<std::string, std::string> metadata, std::unique_ptr<Writer>* out);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // The next bytes of the data section; one call may span several tensors. More bytes than
  // remain declared is kInvalidArgument and writes nothing. After an I/O error every later call
  // fails.
  Status append(const void* data, uint64_t bytes);
  // Checks that every tensor got exactly its bytes, writes the real header, fsyncs and closes.
  Status finish();

  const std::string& path() const { return path_; }
  // The tensors with their computed offsets, in data order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

 private:
  Writer() = default;
  Status write_prefix(bool finished);
  Status fail(Status s);

  std::string path_;
  int fd_ = -1;
  std::vector<TensorInfo> tensors_;
  std::vector<uint32_t> crcs_;
  std::map<std::string, std::string> metadata_;  // the caller's, without the checksums
  uint64_t header_bytes_ = 0;                    // the padded JSON
  uint64_t total_bytes_ = 0;
  uint64_t written_ = 0;
  std::size_t current_ = 0;  // the tensor the next appended byte belongs to
  Status failed_;
  bool finished_ = false;
};

// An open, validated file: sizes, JSON, dtypes, shapes, offsets that are contiguous and cover the
// data section exactly, checksum metadata well formed.
class Reader {
 public:
  // kNotFound for a missing file, kIo for other OS failures, kInvalidArgument ("not a
  // safetensors file: ...") for a malformed one.
  // `max_tensors` below kMaxTensors tightens the cap on entries (tests, fuzzers).
  static Status open(const std::string& path, std::unique_ptr<Reader>* out,
                     std::size_t max_tensors = kMaxTensors);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  const TensorInfo* find(std::string_view name) const;  // nullptr if absent
  // Whether the file records the tensor's CRC-32C (checkpoints require it of every tensor).
  bool has_checksum(const TensorInfo& tensor) const;

  // Reads the whole tensor in pieces of at most chunk_bytes, in order, handing each to
  // sink(data, offset_in_tensor, bytes) (never called for a 0-byte tensor). With a stored CRC it
  // is checked at the end: a mismatch is kDataCorruption naming the tensor and the file, after
  // the sink has seen the bad bytes. Returns the sink's first error. Safe to call from several
  // threads at once (positional reads).
  Status read_tensor(const TensorInfo& tensor, uint64_t chunk_bytes,
                     const std::function<Status(const void*, uint64_t, uint64_t)>& sink) const;

 private:
  Reader() = default;

  std::string path_;
  int fd_ = -1;
  Header header_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> header_.tensors index
  std::vector<int64_t> crcs_;                              // per tensor; -1 when none is stored
};

}  // namespace strata::safetensors
