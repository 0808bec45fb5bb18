// The safetensors header: the JSON a Writer writes (header_json) and the two passes a Reader's
// header goes through (a SAX scan that refuses what a header must not hold, then the tree's
// entries checked one by one and their layout as a whole), and the format's dtype codes.
#include "runtime/checkpoint/safetensors_header.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "common/hex.h"
#include "common/json.h"

namespace strata::safetensors {

namespace {

// A plain (tree-backed) json: ordered_json's linear key lookup made parsing a header of n keys
// take O(n^2) time. The header's key order, which breaks ties between 0-byte tensors sharing an
// offset, is recorded while parsing instead (parse_json).
using Json = nlohmann::json;

// Caps on what a header may declare, so that a hostile one costs bounded time and memory: a
// tensor's entry is nested 3 deep (root, entry, shape), and nothing needs more.
constexpr int kMaxDepth = 3;
// Not hex, so a header whose placeholders were never replaced is rejected even if a torn write
// left its length prefix in place.
constexpr std::string_view kCrcPlaceholder = "--------";
constexpr std::array<std::string_view, kDTypeCount> kCodes = {"F32", "F16", "BF16", "F64", "I8",
                                                              "U8",  "I16", "I32",  "I64", "BOOL"};

bool parse_hex8(std::string_view s, uint32_t* out) {
  if (s.size() != 8) return false;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, 16);
  return ec == std::errc() && end == s.data() + s.size();
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

}  // namespace strata::safetensors
