#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/crc32c.h"
#include "runtime/checkpoint/safetensors.h"
#include "tests/support/core_support.h"

using strata::Code;
using strata::DType;
using strata::Status;
using strata::safetensors::Reader;
using strata::safetensors::TensorInfo;
using strata::safetensors::Writer;

using strata_test::ScratchDir;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

// A file as the format defines it: length, JSON, data.
std::string file_bytes(const std::string& json, const std::string& data) {
  return le64(json.size()) + json + data;
}

TensorInfo tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  TensorInfo t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

std::vector<unsigned char> random_bytes(std::size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

Status open_status(const std::string& path) {
  std::unique_ptr<Reader> r;
  return Reader::open(path, &r);
}

// Reads a tensor through the sink, checking that the pieces come in order and within the size.
Status read_all(const Reader& reader, const TensorInfo& t, uint64_t chunk_bytes,
                std::vector<unsigned char>* out, int* calls = nullptr) {
  out->clear();
  int n = 0;
  const Status s =
      reader.read_tensor(t, chunk_bytes, [&](const void* data, uint64_t offset, uint64_t bytes) {
        REQUIRE(offset == out->size());
        REQUIRE(bytes > 0);
        REQUIRE(bytes <= chunk_bytes);
        const auto* p = static_cast<const unsigned char*>(data);
        out->insert(out->end(), p, p + bytes);
        ++n;
        return Status::ok();
      });
  if (calls != nullptr) *calls = n;
  return s;
}

void require_malformed(const std::string& path, const std::string& needle) {
  const Status s = open_status(path);
  INFO(s.message());
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("not a safetensors file") && Catch::Contains(path) &&
                                Catch::Contains(needle));
}

const std::string kTensorA = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

}  // namespace

TEST_CASE("the built-in CRC-32C equals ISA-L's", "[safetensors]") {
  const std::string s = "123456789";
  REQUIRE(strata::crc32c_extend_builtin(0, s.data(), s.size()) == 0xE3069283u);
  std::vector<unsigned char> data(100003);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                        std::size_t{4097}, data.size()}) {
    REQUIRE(strata::crc32c_extend_builtin(0, data.data(), n) == strata::crc32c(data.data(), n));
  }
  // Where ISA-L is installed the comparison above is against it (install-deps installs it).
  WARN("ISA-L " << (strata::crc32c_uses_isal() ? "found" : "not found: both paths are built-in"));
}

TEST_CASE("crc32c_extend continues a CRC across pieces", "[safetensors]") {
  const std::string s = "123456789";
  REQUIRE(strata::crc32c(s.data(), s.size()) == 0xE3069283u);
  REQUIRE(strata::crc32c_extend(0, s.data(), s.size()) == 0xE3069283u);
  for (std::size_t cut = 0; cut <= s.size(); ++cut) {
    const uint32_t head = strata::crc32c(s.data(), cut);
    REQUIRE(strata::crc32c_extend(head, s.data() + cut, s.size() - cut) == 0xE3069283u);
  }
}

TEST_CASE("safetensors dtype codes round trip", "[safetensors]") {
  for (int i = 0; i < strata::kDTypeCount; ++i) {
    const auto dtype = static_cast<DType>(i);
    DType parsed = DType::kF32;
    REQUIRE_OK(strata::safetensors::parse_dtype(strata::safetensors::dtype_code(dtype), &parsed));
    REQUIRE(parsed == dtype);
  }
  REQUIRE(strata::safetensors::dtype_code(DType::kBF16) == "BF16");
  REQUIRE(strata::safetensors::dtype_code(DType::kBool) == "BOOL");
  DType parsed = DType::kF32;
  REQUIRE(strata::safetensors::parse_dtype("U16", &parsed).code() == Code::kInvalidArgument);
  REQUIRE(strata::safetensors::parse_dtype("f32", &parsed).code() == Code::kInvalidArgument);
}

TEST_CASE("safetensors round trip of several dtypes, shapes and metadata", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("model.safetensors");
  std::vector<TensorInfo> tensors = {
      tensor("w.f32", DType::kF32, {2, 3}),
      tensor("empty", DType::kI64, {4, 0}),
      tensor("w.bf16", DType::kBF16, {5}),
      tensor("scalar", DType::kBool, {}),
      tensor("big.u8", DType::kU8, {1000, 37}),
      tensor("w.f64", DType::kF64, {3, 1, 1}),
      tensor("w.i16", DType::kI16, {7}),
      tensor("w.i32", DType::kI32, {1}),
      tensor("w.i8", DType::kI8, {9}),
      tensor("w.f16", DType::kF16, {2, 2}),
      tensor("trailing.empty", DType::kF32, {0}),
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "1200"}};
  uint64_t total = 0;
  for (const TensorInfo& t : tensors) {
    total += strata::dtype_size(t.dtype) *
             static_cast<uint64_t>(
                 std::accumulate(t.shape.begin(), t.shape.end(), int64_t{1}, std::multiplies<>()));
  }
  const std::vector<unsigned char> data = random_bytes(total, 7);

  std::unique_ptr<Writer> writer;
  REQUIRE_OK(Writer::create(path, tensors, metadata, &writer));
  // Odd-sized pieces that straddle tensor boundaries, including the 0-byte tensors.
  for (uint64_t off = 0; off < total;) {
    const uint64_t n = std::min<uint64_t>(13, total - off);
    REQUIRE_OK(writer->append(data.data() + off, n));
    off += n;
  }
  REQUIRE_OK(writer->append(nullptr, 0));
  REQUIRE_OK(writer->finish());
  writer.reset();

  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  const auto& header = reader->header();
  REQUIRE(header.data_start % 8 == 0);
  REQUIRE(header.data_start + total == std::filesystem::file_size(path));
  REQUIRE(header.metadata.at("format") == "pt");
  REQUIRE(header.metadata.at("step") == "1200");
  REQUIRE(header.metadata.size() == metadata.size() + tensors.size());
  REQUIRE(header.metadata.at("crc32c.empty") == "00000000");
  REQUIRE(header.tensors.size() == tensors.size());
  uint64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = header.tensors[i];
    INFO(t.name);
    REQUIRE(t.name == tensors[i].name);  // data order is the declared order
    REQUIRE(t.dtype == tensors[i].dtype);
    REQUIRE(t.shape == tensors[i].shape);
    REQUIRE(t.begin == offset);
    offset = t.end;
    REQUIRE(reader->find(t.name) == &t);
    const std::vector<unsigned char> expected(data.begin() + static_cast<std::ptrdiff_t>(t.begin),
                                              data.begin() + static_cast<std::ptrdiff_t>(t.end));
    std::vector<unsigned char> got;
    int calls = -1;
    REQUIRE_OK(read_all(*reader, t, 64 << 20, &got, &calls));
    REQUIRE(got == expected);
    REQUIRE(calls == (t.end == t.begin ? 0 : 1));
  }
  REQUIRE(reader->find("missing") == nullptr);

  // The large tensor in many pieces, the last one short.
  const TensorInfo* big = reader->find("big.u8");
  REQUIRE(big != nullptr);
  std::vector<unsigned char> got;
  int calls = 0;
  REQUIRE_OK(read_all(*reader, *big, 4096, &got, &calls));
  REQUIRE(calls == 10);  // 37000 bytes: 9 of 4096 and one of 136
  REQUIRE(got == std::vector<unsigned char>(data.begin() + static_cast<std::ptrdiff_t>(big->begin),
                                            data.begin() + static_cast<std::ptrdiff_t>(big->end)));
}

TEST_CASE("safetensors writer output matches a file built by hand from the spec", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("a.safetensors");
  const float values[2] = {1.0f, 2.0f};
  std::unique_ptr<Writer> writer;
  REQUIRE_OK(Writer::create(path, {tensor("a", DType::kF32, {2})}, {{"format", "pt"}}, &writer));
  REQUIRE_OK(writer->append(values, sizeof(values)));
  REQUIRE_OK(writer->finish());

  // CRC-32C of 00 00 80 3f 00 00 00 40, computed by an independent bitwise implementation.
  const std::string json = R"({"__metadata__":{"crc32c.a":"28c0c9b1","format":"pt"},)"
                           R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE(json.size() == 107);
  const std::string expected =
      le64(112) + json + "     " + std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  REQUIRE(read_file(path) == expected);
}

TEST_CASE("safetensors reads a file built by hand from the spec", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("hand.safetensors");
  // Unpadded header, tensors listed out of data order, a 0-byte tensor, no checksums.
  const std::string json = R"({"b":{"dtype":"I16","shape":[1,2],"data_offsets":[8,12]},)"
                           R"("z":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},)" +
                           kTensorA + R"(,"__metadata__":{"format":"pt"}})";
  const std::string data = std::string("\x00\x00\x80\x3f\x00\x00\x00\x40\x01\x00\xff\xff", 12);
  write_file(path, file_bytes(json, data));

  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  const auto& h = reader->header();
  REQUIRE(h.data_start == 8 + json.size());
  REQUIRE(h.metadata == std::map<std::string, std::string>{{"format", "pt"}});
  REQUIRE(h.tensors.size() == 3);
  REQUIRE(h.tensors[0].name == "a");
  REQUIRE(h.tensors[1].name == "z");
  REQUIRE(h.tensors[2].name == "b");
  REQUIRE(h.tensors[2].dtype == DType::kI16);
  REQUIRE(h.tensors[2].shape == std::vector<int64_t>{1, 2});

  std::vector<unsigned char> got;
  REQUIRE_OK(read_all(*reader, h.tensors[0], 3, &got));
  float values[2];
  std::memcpy(values, got.data(), sizeof(values));
  REQUIRE(values[0] == 1.0f);
  REQUIRE(values[1] == 2.0f);
  REQUIRE_OK(read_all(*reader, h.tensors[2], 100, &got));
  int16_t ints[2];
  std::memcpy(ints, got.data(), sizeof(ints));
  REQUIRE(ints[0] == 1);
  REQUIRE(ints[1] == -1);
}

TEST_CASE("safetensors flipped data byte is kDataCorruption naming tensor and file",
          "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("c.safetensors");
  const std::vector<unsigned char> data = random_bytes(3000, 3);
  std::unique_ptr<Writer> writer;
  REQUIRE_OK(Writer::create(
      path, {tensor("first", DType::kU8, {1000}), tensor("layer.3.weight", DType::kF32, {500})}, {},
      &writer));
  REQUIRE_OK(writer->append(data.data(), data.size()));
  REQUIRE_OK(writer->finish());

  std::string bytes = read_file(path);
  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  const uint64_t victim = reader->header().data_start + 1000 + 1234;
  reader.reset();
  bytes[victim] = static_cast<char>(bytes[victim] ^ 0x10);
  write_file(path, bytes);

  REQUIRE_OK(Reader::open(path, &reader));
  std::vector<unsigned char> got;
  REQUIRE_OK(read_all(*reader, *reader->find("first"), 256, &got));
  const Status s = read_all(*reader, *reader->find("layer.3.weight"), 256, &got);
  INFO(s.message());
  REQUIRE(s.code() == Code::kDataCorruption);
  REQUIRE_THAT(s.message(), Catch::Contains("layer.3.weight") && Catch::Contains(path));
}

TEST_CASE("safetensors read_tensor returns the sink's first error", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("s.safetensors");
  const std::vector<unsigned char> data = random_bytes(100, 5);
  std::unique_ptr<Writer> writer;
  REQUIRE_OK(Writer::create(path, {tensor("t", DType::kU8, {100})}, {}, &writer));
  REQUIRE_OK(writer->append(data.data(), data.size()));
  REQUIRE_OK(writer->finish());
  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  int calls = 0;
  const Status s =
      reader->read_tensor(*reader->find("t"), 10, [&](const void*, uint64_t, uint64_t) {
        return ++calls == 2 ? Status(Code::kCancelled, "stop") : Status::ok();
      });
  REQUIRE(s.code() == Code::kCancelled);
  REQUIRE(calls == 2);
  REQUIRE(reader
              ->read_tensor(*reader->find("t"), 0,
                            [](const void*, uint64_t, uint64_t) { return Status::ok(); })
              .code() == Code::kInvalidArgument);
  const TensorInfo stranger = tensor("t", DType::kU8, {5});
  REQUIRE(
      reader
          ->read_tensor(stranger, 10, [](const void*, uint64_t, uint64_t) { return Status::ok(); })
          .code() == Code::kInvalidArgument);
}

TEST_CASE("safetensors rejects missing, short and truncated files", "[safetensors]") {
  ScratchDir dir;
  const std::string missing = dir.file("missing.safetensors");
  const Status s = open_status(missing);
  REQUIRE(s.code() == Code::kNotFound);
  REQUIRE_THAT(s.message(), Catch::Contains(missing));

  const std::string path = dir.file("bad.safetensors");
  write_file(path, "");
  require_malformed(path, "8-byte header length");
  write_file(path, std::string("\x05\x00\x00", 3));
  require_malformed(path, "8-byte header length");

  // A valid file, then the same minus its last byte.
  const std::string good = file_bytes("{" + kTensorA + "}", std::string(8, '\x01'));
  write_file(path, good);
  REQUIRE_OK(open_status(path));
  write_file(path, good.substr(0, good.size() - 1));
  require_malformed(path, "truncated");
  write_file(path, good + "x");
  require_malformed(path, "belong to no tensor");
}

TEST_CASE("safetensors rejects header lengths beyond the file or the limit", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("len.safetensors");
  const std::string json = "{" + kTensorA + "}";
  write_file(path, le64(json.size() + 100) + json + std::string(8, '\0'));
  require_malformed(path, "header length");
  write_file(path, le64(200'000'000) + json + std::string(8, '\0'));
  require_malformed(path, "limit");
  write_file(path, le64(0) + json + std::string(8, '\0'));
  require_malformed(path, "header length is 0");
}

TEST_CASE("safetensors rejects malformed headers", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("h.safetensors");
  auto check = [&](const std::string& json, const std::string& data, const std::string& needle) {
    INFO(json);
    write_file(path, file_bytes(json, data));
    require_malformed(path, needle);
  };
  const std::string eight(8, '\0');
  const std::string sixteen(16, '\0');
  check("{\"a\":", eight, "not valid JSON");
  check("[1,2]", eight, "not a JSON object");
  check("{" + kTensorA + "," + kTensorA + "}", eight, "twice");
  // Overlapping and gapped regions.
  check("{" + kTensorA + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
        std::string(12, '\0'), "overlaps");
  check("{" + kTensorA + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})", sixteen,
        "belong to no tensor");
  check(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight, "belong to no tensor");
  // Dtypes, shapes and offsets.
  check(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", eight, "F99");
  check(R"({"a":{"dtype":"U16","shape":[4],"data_offsets":[0,8]}})", eight, "U16");
  check(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight, "needs 12 bytes");
  check(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight, "non-negative");
  check(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", eight, "non-negative");
  check(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", eight,
        "overflows");
  check(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight, "end before");
  check(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight, "data_offsets");
  check(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", eight, "dtype");
  check(R"({"a":[1]})", eight, "not an object");
  check(R"({"__metadata__":{"k":1},)" + kTensorA + "}", eight, "metadata \"k\"");
  check(R"({"__metadata__":[],)" + kTensorA + "}", eight, "__metadata__");
  check(R"({"__metadata__":{"crc32c.a":"xyz"},)" + kTensorA + "}", eight, "crc32c.a");
}

TEST_CASE("safetensors writer rejects too many and too few bytes", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("w.safetensors");
  const std::vector<unsigned char> data = random_bytes(64, 9);
  std::unique_ptr<Writer> writer;
  REQUIRE_OK(Writer::create(path, {tensor("x", DType::kF32, {4}), tensor("y", DType::kI64, {2})},
                            {}, &writer));
  REQUIRE_OK(writer->append(data.data(), 10));
  Status s = writer->append(data.data(), 30);  // 32 declared
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains(path) && Catch::Contains("exceeds"));
  s = writer->finish();  // the rejected append wrote nothing: x has 10 of 16 bytes
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("\"x\" got 10 of its 16 bytes"));
  REQUIRE_OK(writer->append(data.data() + 10, 10));
  s = writer->finish();
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("\"y\" got 4 of its 16 bytes"));
  REQUIRE_OK(writer->append(data.data() + 20, 12));
  REQUIRE_OK(writer->finish());
  REQUIRE(writer->append(data.data(), 1).code() == Code::kInvalidState);
  REQUIRE(writer->finish().code() == Code::kInvalidState);

  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  std::vector<unsigned char> got;
  REQUIRE_OK(read_all(*reader, *reader->find("y"), 5, &got));
  REQUIRE(got == std::vector<unsigned char>(data.begin() + 16, data.begin() + 32));
}

TEST_CASE("safetensors writer rejects bad declarations", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("d.safetensors");
  std::unique_ptr<Writer> writer;
  auto create = [&](std::vector<TensorInfo> tensors, std::map<std::string, std::string> meta) {
    return Writer::create(path, std::move(tensors), std::move(meta), &writer).code();
  };
  REQUIRE(create({tensor("a", DType::kU8, {1}), tensor("a", DType::kU8, {1})}, {}) ==
          Code::kInvalidArgument);
  REQUIRE(create({tensor("", DType::kU8, {1})}, {}) == Code::kInvalidArgument);
  REQUIRE(create({tensor("__metadata__", DType::kU8, {1})}, {}) == Code::kInvalidArgument);
  REQUIRE(create({tensor("a", DType::kU8, {-1})}, {}) == Code::kInvalidArgument);
  REQUIRE(create({tensor("a", static_cast<DType>(42), {1})}, {}) == Code::kInvalidArgument);
  REQUIRE(create({tensor("a", DType::kU8, {1})}, {{"crc32c.a", "0"}}) == Code::kInvalidArgument);
  REQUIRE(create({tensor("bad\xff", DType::kU8, {1})}, {}) == Code::kInvalidArgument);
  REQUIRE(writer == nullptr);
  REQUIRE(Writer::create(dir.file("no/such/dir/x.safetensors"), {}, {}, &writer).code() ==
          Code::kIo);

  // No tensors at all is a valid (empty) file.
  REQUIRE_OK(Writer::create(path, {}, {}, &writer));
  REQUIRE(writer->append("x", 1).code() == Code::kInvalidArgument);
  REQUIRE_OK(writer->finish());
  std::unique_ptr<Reader> reader;
  REQUIRE_OK(Reader::open(path, &reader));
  REQUIRE(reader->header().tensors.empty());
}

TEST_CASE("safetensors file of a writer destroyed without finish is rejected", "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("u.safetensors");
  const std::vector<unsigned char> data = random_bytes(48, 11);
  const std::vector<TensorInfo> tensors = {tensor("p", DType::kF64, {2}),
                                           tensor("q", DType::kI32, {8})};
  SECTION("with part of the data") {
    std::unique_ptr<Writer> writer;
    REQUIRE_OK(Writer::create(path, tensors, {}, &writer));
    REQUIRE_OK(writer->append(data.data(), 20));
  }
  SECTION("with all the data") {
    std::unique_ptr<Writer> writer;
    REQUIRE_OK(Writer::create(path, tensors, {}, &writer));
    REQUIRE_OK(writer->append(data.data(), data.size()));
  }
  SECTION("with the length prefix but placeholder checksums (a torn header write)") {
    std::unique_ptr<Writer> writer;
    REQUIRE_OK(Writer::create(path, tensors, {}, &writer));
    REQUIRE_OK(writer->append(data.data(), data.size()));
    writer.reset();
    std::string bytes = read_file(path);
    const uint64_t header_bytes = bytes.size() - 8 - data.size();
    bytes.replace(0, 8, le64(header_bytes));
    write_file(path, bytes);
    require_malformed(path, "crc32c.");
  }
  require_malformed(path, "");
}

TEST_CASE("safetensors refuses deep nesting and too many entries before parsing on",
          "[safetensors]") {
  ScratchDir dir;
  const std::string path = dir.file("h.safetensors");
  const std::string eight(8, '\0');
  // 100k levels of nesting: refused at level 4, without memory growing with the depth.
  write_file(path, file_bytes(std::string(100000, '[') + std::string(100000, ']'), eight));
  require_malformed(path, "nests deeper");
  write_file(path,
             file_bytes(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", eight));
  require_malformed(path, "nests deeper");
  // One tensor more than the cap (tightened for the test; the default is kMaxTensors).
  std::string json = "{";
  for (std::size_t i = 0; i <= 100; ++i) {
    if (i > 0) json += ',';
    json += "\"t" + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})";
  }
  json += "}";
  write_file(path, file_bytes(json, ""));
  std::unique_ptr<Reader> r;
  const Status s = Reader::open(path, &r, 100);
  INFO(s.message());
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("more than 100 tensors"));
  REQUIRE(Reader::open(path, &r, 101).is_ok());
}

TEST_CASE("safetensors header parsing and writing are linear in the tensor count",
          "[safetensors]") {
  // 100k tensors took a minute with ordered_json (quadratic); linear, well under a second
  // optimized. Time both sizes and require near-linear growth, with generous slack.
  ScratchDir dir;
  auto run = [&](std::size_t n) {
    std::vector<TensorInfo> tensors;
    tensors.reserve(n);
    for (std::size_t i = 0; i < n; ++i)
      tensors.push_back(tensor("t" + std::to_string(i), DType::kU8, {1}));
    const std::string path = dir.file("n" + std::to_string(n) + ".safetensors");
    const auto start = std::chrono::steady_clock::now();
    std::unique_ptr<Writer> w;
    REQUIRE(Writer::create(path, tensors, {}, &w).is_ok());
    const std::vector<unsigned char> data(n, 7);
    REQUIRE(w->append(data.data(), data.size()).is_ok());
    REQUIRE(w->finish().is_ok());
    std::unique_ptr<Reader> r;
    REQUIRE(Reader::open(path, &r).is_ok());
    REQUIRE(r->header().tensors.size() == n);
    // Text order is kept: t0, t1, ... as written.
    REQUIRE(r->header().tensors[n - 1].name == "t" + std::to_string(n - 1));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const double small = run(12500);
  const double large = run(100000);
  INFO("12.5k: " << small << " s, 100k: " << large << " s");
  REQUIRE(large < 8 * small * 3 + 0.5);  // 8x the entries; quadratic would be 64x
}
