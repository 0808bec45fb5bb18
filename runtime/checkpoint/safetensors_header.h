// The safetensors header's encoding and decoding (safetensors_header.cpp), which the Writer and
// the Reader (safetensors.cpp) share: its framing, the JSON written and the JSON checked. Private
// to runtime/checkpoint/.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "runtime/checkpoint/safetensors.h"

namespace strata::safetensors {

// The reference implementation's cap; it keeps a corrupt length from allocating gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr uint64_t kLengthBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::string_view kCrcPrefix = "crc32c.";

template <typename... Args>
Status malformed(const std::string& path, const Args&... what) {
  return error(Code::kInvalidArgument, "not a safetensors file: ", path, ": ", what...);
}

// Bytes of a tensor of this shape; false on overflow.
bool tensor_bytes(const std::vector<int64_t>& shape, DType dtype, uint64_t* out);
std::string shape_string(const std::vector<int64_t>& shape);

// The JSON of a header, unpadded, written out directly in one pass (linear in the tensors).
// Without crcs the checksums are placeholders of the same length, so the final header fits
// exactly where the first one was written. Throws nlohmann::json::exception on invalid UTF-8.
std::string header_json(const std::vector<TensorInfo>& tensors,
                        const std::map<std::string, std::string>& metadata,
                        const std::vector<uint32_t>* crcs);

// The header's text, checked (at most max_entries tensors, which tile data_bytes exactly, their
// checksums well formed) into *header's tensors (in data order) and metadata; *crcs per tensor,
// -1 where none is stored.
Status parse_header(const std::string& path, const std::string& text, uint64_t data_bytes,
                    std::size_t max_entries, Header* header, std::vector<int64_t>* crcs);

}  // namespace strata::safetensors
