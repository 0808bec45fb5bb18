// The NVMe tier through the C++ core, where a test hook can inject faults into the storage
// engine: short transfers, EIO, ENOSPC, and bits flipped on disk. Every case runs on both
// engines (io_uring and the POSIX pool).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "common/crc32c.h"
#include "runtime/runtime.h"
#include "support/test_support.h"

using namespace strata;
using strata_test::random_bytes;
using strata_test::ScratchDir;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

struct Fixture {
  ScratchDir scratch;
  std::shared_ptr<Runtime> rt;
  std::vector<std::string> paths;
  // The hook consults this; tests replace it to inject faults.
  std::shared_ptr<IoFaultHook> fault = std::make_shared<IoFaultHook>();

  Fixture(IoEngineKind engine, int path_count = 1, uint64_t block = 256 * 1024,
          uint64_t nvme = 64 * kMiB, uint64_t dram = 64 * kMiB, uint64_t hbm = 64 * kMiB,
          bool direct_dram = false) {
    RuntimeOptions o;
    o.device.kind = DeviceKind::kHost;
    o.budgets = {hbm, dram, nvme};
    for (int i = 0; i < path_count; ++i) paths.push_back(scratch.file("nvme" + std::to_string(i)));
    o.nvme.paths = paths;
    o.nvme.engine = engine;
    o.nvme.block_size = block;
    o.nvme.queue_depth = 4;
    o.nvme.checksums = true;
    o.nvme.direct_dram = direct_dram;
    auto hook = fault;
    o.nvme.fault_hook = [hook](IoOp op, int file, uint64_t offset, uint64_t len, int64_t result) {
      return *hook ? (*hook)(op, file, offset, len, result) : result;
    };
    const Status s = Runtime::create(o, &rt);
    INFO(s.message());
    REQUIRE(s.is_ok());
  }

  TensorId tensor(const std::string& name, uint64_t bytes, Tier home,
                  const std::vector<unsigned char>* data = nullptr) {
    TensorSpec spec;
    spec.name = name;
    spec.dtype = DType::kU8;
    spec.shape = {static_cast<int64_t>(bytes)};
    spec.home = home;
    TensorId id = 0;
    REQUIRE(rt->register_tensor(spec, &id).is_ok());
    if (data != nullptr) REQUIRE(rt->write(id, 0, data->data(), data->size()).is_ok());
    return id;
  }

  Status move(TensorId id, Tier dst) {
    std::shared_ptr<Completion> done;
    STRATA_RETURN_IF_ERROR(rt->move(id, dst, nullptr, &done));
    return done->wait(-1);
  }

  Tier tier(TensorId id) {
    TensorRecord r;
    REQUIRE(rt->info(id, &r).is_ok());
    return r.tier;
  }

  std::vector<unsigned char> read(TensorId id, uint64_t bytes) {
    std::vector<unsigned char> out(bytes);
    const Status s = rt->read(id, 0, out.data(), bytes);
    INFO(s.message());
    REQUIRE(s.is_ok());
    return out;
  }

  uint64_t nvme_offset(TensorId id) {
    TensorRecord r;
    REQUIRE(rt->info(id, &r).is_ok());
    REQUIRE(r.tier == Tier::kNvme);
    return r.offset;
  }
};

void flip_bit(const std::string& path, uint64_t byte, int bit) {
  const int fd = open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char b = 0;
  REQUIRE(pread(fd, &b, 1, static_cast<off_t>(byte)) == 1);
  b ^= static_cast<unsigned char>(1u << bit);
  REQUIRE(pwrite(fd, &b, 1, static_cast<off_t>(byte)) == 1);
  REQUIRE(fsync(fd) == 0);
  close(fd);
}

// Every fault case runs on both engines and both DRAM paths (staged and direct).
struct Variant {
  IoEngineKind engine;
  bool direct;
};
const Variant kVariants[] = {{IoEngineKind::kUring, false},
                             {IoEngineKind::kUring, true},
                             {IoEngineKind::kPosix, false},
                             {IoEngineKind::kPosix, true}};

Fixture make(const Variant& v) {
  return Fixture(v.engine, 1, 256 * 1024, 64 * kMiB, 64 * kMiB, 64 * kMiB, v.direct);
}

}  // namespace

TEST_CASE("crc32c matches the standard check value", "[nvme][crc]") {
  const char* check = "123456789";
  REQUIRE(crc32c(check, 9) == 0xE3069283u);
  REQUIRE(crc32c(check, 0) == 0u);
  const auto data = random_bytes(3 * kMiB + 5, 1);
  const uint32_t whole = crc32c(data.data(), data.size());
  auto flipped = data;
  flipped[12345] ^= 0x10;
  REQUIRE(crc32c(flipped.data(), flipped.size()) != whole);
}

TEST_CASE("short reads and writes are resumed to completion", "[nvme]") {
  for (const Variant& v : kVariants) {
    INFO("engine " << static_cast<int>(v.engine) << " direct " << v.direct);
    Fixture f = make(v);
    std::atomic<int> shortened{0};
    // Every transfer longer than 8 KiB stops after half its length (kept 4 KiB aligned).
    *f.fault = [&](IoOp, int, uint64_t, uint64_t len, int64_t result) -> int64_t {
      if (result > 8192) {
        ++shortened;
        return static_cast<int64_t>((len / 2) / 4096 * 4096);
      }
      return result;
    };
    const auto data = random_bytes(3 * kMiB + 77, 2);
    const TensorId t = f.tensor("short", data.size(), Tier::kDram, &data);
    REQUIRE(f.move(t, Tier::kNvme).is_ok());
    REQUIRE(f.move(t, Tier::kHbm).is_ok());
    REQUIRE(f.move(t, Tier::kNvme).is_ok());
    REQUIRE(f.move(t, Tier::kDram).is_ok());
    REQUIRE(f.read(t, data.size()) == data);
    REQUIRE(shortened > 0);
  }
}

TEST_CASE("EIO on read fails the move with path and errno and keeps the NVMe copy", "[nvme]") {
  for (const Variant& v : kVariants) {
    INFO("engine " << static_cast<int>(v.engine) << " direct " << v.direct);
    Fixture f = make(v);
    const auto data = random_bytes(2 * kMiB + 3, 3);
    const TensorId t = f.tensor("eio", data.size(), Tier::kDram, &data);
    REQUIRE(f.move(t, Tier::kNvme).is_ok());
    *f.fault = [](IoOp op, int, uint64_t, uint64_t, int64_t result) -> int64_t {
      return op == IoOp::kRead ? -EIO : result;
    };
    for (Tier dst : {Tier::kDram, Tier::kHbm}) {
      const Status s = f.move(t, dst);
      REQUIRE(s.code() == Code::kIo);
      REQUIRE_THAT(s.message(), Catch::Contains("'eio'") && Catch::Contains(f.paths[0]) &&
                                    Catch::Contains("errno 5"));
      REQUIRE(f.tier(t) == Tier::kNvme);
    }
    std::vector<unsigned char> buf(16);
    REQUIRE(f.rt->read(t, 0, buf.data(), buf.size()).code() == Code::kIo);
    *f.fault = nullptr;
    REQUIRE(f.move(t, Tier::kHbm).is_ok());
    REQUIRE(f.read(t, data.size()) == data);
    // Nothing leaked: only this tensor's blocks are in use.
    REQUIRE(f.rt->tier_usage(Tier::kNvme).used == 0);
    REQUIRE(f.rt->tier_usage(Tier::kDram).used == 0);
  }
}

TEST_CASE("ENOSPC on write fails the move and never releases the source", "[nvme]") {
  for (const Variant& v : kVariants) {
    INFO("engine " << static_cast<int>(v.engine) << " direct " << v.direct);
    Fixture f = make(v);
    const auto data = random_bytes(2 * kMiB + 999, 4);
    const TensorId from_dram = f.tensor("from_dram", data.size(), Tier::kDram, &data);
    const TensorId from_hbm = f.tensor("from_hbm", data.size(), Tier::kHbm, &data);
    *f.fault = [](IoOp op, int, uint64_t offset, uint64_t, int64_t result) -> int64_t {
      return op == IoOp::kWrite && offset >= 256 * 1024 ? -ENOSPC : result;  // not the first piece
    };
    for (auto [t, home] : {std::pair{from_dram, Tier::kDram}, std::pair{from_hbm, Tier::kHbm}}) {
      const Status s = f.move(t, Tier::kNvme);
      REQUIRE(s.code() == Code::kIo);
      REQUIRE_THAT(s.message(), Catch::Contains("errno 28") && Catch::Contains(f.paths[0]));
      REQUIRE(f.tier(t) == home);
      REQUIRE(f.read(t, data.size()) == data);
    }
    REQUIRE(f.rt->tier_usage(Tier::kNvme).used == 0);
    *f.fault = nullptr;
    REQUIRE(f.move(from_hbm, Tier::kNvme).is_ok());
    REQUIRE(f.read(from_hbm, data.size()) == data);
  }
}

TEST_CASE("a bit flipped on disk is detected every time, naming tensor and offset", "[nvme]") {
  for (const Variant& v : kVariants) {
    INFO("engine " << static_cast<int>(v.engine) << " direct " << v.direct);
    Fixture f = make(v);
    const uint64_t size = 1 * kMiB + 4097;
    const auto data = random_bytes(size, 5);
    const TensorId t = f.tensor("flip", size, Tier::kDram, &data);
    std::mt19937_64 rng(11);
    for (int trial = 0; trial < 12; ++trial) {
      REQUIRE(f.move(t, Tier::kNvme).is_ok());
      const uint64_t base = f.nvme_offset(t);
      const uint64_t byte = rng() % size;
      const int bit = static_cast<int>(rng() % 8);
      flip_bit(f.paths[0], base + byte, bit);
      const Tier dst = trial % 2 == 0 ? Tier::kDram : Tier::kHbm;
      const Status s = f.move(t, dst);
      INFO("trial " << trial << " byte " << byte << " bit " << bit << ": " << s.message());
      REQUIRE(s.code() == Code::kDataCorruption);
      const uint64_t piece = byte / (256 * 1024) * (256 * 1024);
      REQUIRE_THAT(s.message(), Catch::Contains("'flip'") &&
                                    Catch::Contains("bytes [" + std::to_string(piece) + ", "));
      REQUIRE(f.tier(t) == Tier::kNvme);
      std::vector<unsigned char> one(1);
      REQUIRE(f.rt->read(t, byte, one.data(), 1).code() == Code::kDataCorruption);
      flip_bit(f.paths[0], base + byte, bit);  // repair: the move now succeeds
      REQUIRE(f.move(t, Tier::kDram).is_ok());
      REQUIRE(f.read(t, size) == data);
    }
  }
}

TEST_CASE("striping spreads stripe units round-robin over the paths", "[nvme]") {
  const uint64_t block = 64 * 1024;
  Fixture f(IoEngineKind::kAuto, 2, block);
  const uint64_t size = 16 * block;
  const auto data = random_bytes(size, 6);
  const TensorId t = f.tensor("striped", size, Tier::kDram, &data);
  REQUIRE(f.move(t, Tier::kNvme).is_ok());
  const uint64_t base = f.nvme_offset(t);
  REQUIRE(base % (2 * block) == 0);  // the first tensor starts at logical 0
  for (int file = 0; file < 2; ++file) {
    std::ifstream in(f.paths[file], std::ios::binary);
    std::vector<unsigned char> on_disk(size / 2);
    in.read(reinterpret_cast<char*>(on_disk.data()), static_cast<std::streamsize>(on_disk.size()));
    for (uint64_t s = 0; s < 8; ++s) {  // file `file` holds stripes file, file + 2, ...
      const uint64_t stripe = 2 * s + static_cast<uint64_t>(file);
      REQUIRE(std::equal(on_disk.begin() + static_cast<long>(s * block),
                         on_disk.begin() + static_cast<long>((s + 1) * block),
                         data.begin() + static_cast<long>(stripe * block)));
    }
  }
  REQUIRE(f.move(t, Tier::kHbm).is_ok());
  REQUIRE(f.read(t, size) == data);
}

TEST_CASE("partial writes to an NVMe tensor keep checksums right", "[nvme]") {
  Fixture f(IoEngineKind::kAuto);
  const uint64_t size = 700 * 1024 + 3;
  auto data = random_bytes(size, 7);
  const TensorId t = f.tensor("patched", size, Tier::kNvme);
  REQUIRE(f.rt->write(t, 0, data.data(), size).is_ok());
  const auto patch = random_bytes(300 * 1024, 8);  // spans two pieces, unaligned
  REQUIRE(f.rt->write(t, 200 * 1024 + 17, patch.data(), patch.size()).is_ok());
  std::copy(patch.begin(), patch.end(), data.begin() + 200 * 1024 + 17);
  REQUIRE(f.read(t, size) == data);
  REQUIRE(f.move(t, Tier::kHbm).is_ok());  // the whole extent checks out
  REQUIRE(f.read(t, size) == data);
}

TEST_CASE("a damaged NVMe tensor is repaired by writing it whole, its padded tail unread",
          "[nvme]") {
  // 700 KiB + 3: the last 256 KiB piece ends in padding. A write of the whole tensor covers
  // every data byte of that piece, so it must not read (and fail to verify) what is there:
  // a checkpoint load once could not restore such a tensor after its bytes rotted.
  Fixture f(IoEngineKind::kAuto);
  const uint64_t size = 700 * 1024 + 3;
  const auto data = random_bytes(size, 12);
  const TensorId t = f.tensor("rotten", size, Tier::kNvme);
  REQUIRE(f.rt->write(t, 0, data.data(), size).is_ok());
  const uint64_t base = f.nvme_offset(t);
  flip_bit(f.paths[0], base + size - 1, 3);  // in the last piece
  std::vector<unsigned char> one(1);
  REQUIRE(f.rt->read(t, size - 1, one.data(), 1).code() == Code::kDataCorruption);
  // A partial write of that piece still reads it first, and refuses the damaged bytes.
  REQUIRE(f.rt->write(t, size - 2, data.data(), 1).code() == Code::kDataCorruption);
  const auto fresh = random_bytes(size, 13);
  REQUIRE(f.rt->write(t, 0, fresh.data(), size).is_ok());
  REQUIRE(f.read(t, size) == fresh);
  REQUIRE(f.move(t, Tier::kHbm).is_ok());  // the whole extent checks out
  REQUIRE(f.read(t, size) == fresh);
}

TEST_CASE(
    "byte ranges over more pieces than are kept in flight round-trip, and a failed piece "
    "mid-range leaves the rest of the tensor as it was",
    "[nvme]") {
  // 64 KiB pieces: a 3 MiB tensor has 49, several times NvmeTier::kRangeDepth and the queue
  // depth (4), so reads and writes of a range reuse their buffers while others are in flight.
  for (IoEngineKind engine : {IoEngineKind::kUring, IoEngineKind::kPosix}) {
    INFO("engine " << static_cast<int>(engine));
    Fixture f(engine, 2, 64 * 1024);
    const uint64_t size = 3 * kMiB + 5;
    auto mirror = random_bytes(size, 21);
    const TensorId t = f.tensor("ranges", size, Tier::kNvme);
    REQUIRE(f.rt->write(t, 0, mirror.data(), size).is_ok());
    REQUIRE(f.read(t, size) == mirror);
    const std::pair<uint64_t, uint64_t> ranges[] = {
        {0, size}, {1, size - 2}, {65536, 2 * kMiB}, {65535, 65538}, {777777, 1234567}};
    uint64_t seed = 22;
    for (auto [offset, bytes] : ranges) {
      const auto patch = random_bytes(bytes, seed++);
      REQUIRE(f.rt->write(t, offset, patch.data(), bytes).is_ok());
      std::copy(patch.begin(), patch.end(), mirror.begin() + static_cast<std::ptrdiff_t>(offset));
      std::vector<unsigned char> part(bytes);
      REQUIRE(f.rt->read(t, offset, part.data(), bytes).is_ok());
      REQUIRE(std::equal(part.begin(), part.end(), mirror.begin() + offset));
    }
    REQUIRE(f.read(t, size) == mirror);
    // The 7th piece of a 40-piece range fails: an error, the bytes outside the range as they
    // were, the tensor readable (the range itself unspecified), and the same write succeeds
    // once the fault is gone.
    const uint64_t offset = 100000, bytes = 40 * 65536;
    const auto patch = random_bytes(bytes, 99);
    std::atomic<int> writes{0};  // the hook runs on the engine's threads
    *f.fault = [&writes](IoOp op, int, uint64_t, uint64_t, int64_t result) -> int64_t {
      return op == IoOp::kWrite && ++writes == 7 ? -EIO : result;
    };
    const Status failed = f.rt->write(t, offset, patch.data(), bytes);
    REQUIRE(failed.code() == Code::kIo);
    *f.fault = nullptr;
    std::vector<unsigned char> now(size);
    const Status readable = f.rt->read(t, 0, now.data(), size);
    INFO(readable.message());
    REQUIRE(readable.is_ok());
    REQUIRE(std::equal(now.begin(), now.begin() + offset, mirror.begin()));
    REQUIRE(std::equal(now.begin() + offset + bytes, now.end(), mirror.begin() + offset + bytes));
    REQUIRE(f.rt->write(t, offset, patch.data(), bytes).is_ok());
    std::copy(patch.begin(), patch.end(), mirror.begin() + offset);
    REQUIRE(f.read(t, size) == mirror);
  }
}

TEST_CASE("one byte and unaligned sizes round-trip through every tier", "[nvme]") {
  Fixture f(IoEngineKind::kAuto, 2, 64 * 1024);
  for (uint64_t size : {1ull, 511ull, 4095ull, 4097ull, 65535ull, 65537ull, 200001ull}) {
    const auto data = random_bytes(size, size);
    const TensorId t = f.tensor("u" + std::to_string(size), size, Tier::kHbm, &data);
    for (Tier dst : {Tier::kNvme, Tier::kDram, Tier::kNvme, Tier::kHbm}) {
      const Status s = f.move(t, dst);
      INFO(size << " -> " << tier_name(dst) << ": " << s.message());
      REQUIRE(s.is_ok());
      REQUIRE(f.read(t, size) == data);
    }
    REQUIRE(f.rt->unregister(t).is_ok());
  }
}

TEST_CASE("several GiB round-trip DRAM -> NVMe -> HBM -> NVMe -> DRAM", "[nvme][slow]") {
  const uint64_t size = 3ull << 30;
  Fixture f(IoEngineKind::kAuto, 2, 1 * kMiB, size + 64 * kMiB, size + 64 * kMiB, size + 64 * kMiB);
  const TensorId t = f.tensor("big", size, Tier::kDram);
  // Fill and check in 64 MiB slices from a cheap generator: no 3 GiB reference copy needed.
  auto fill = [](std::vector<uint64_t>& v, uint64_t slice) {
    uint64_t x = 0x9E3779B97F4A7C15ull * (slice + 1);
    for (auto& w : v) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      w = x;
    }
  };
  const uint64_t slice = 64 * kMiB;
  std::vector<uint64_t> buf(slice / 8), expect(slice / 8);
  for (uint64_t s = 0; s < size / slice; ++s) {
    fill(buf, s);
    REQUIRE(f.rt->write(t, s * slice, buf.data(), slice).is_ok());
  }
  for (Tier dst : {Tier::kNvme, Tier::kHbm, Tier::kNvme, Tier::kDram}) {
    const Status s = f.move(t, dst);
    INFO(s.message());
    REQUIRE(s.is_ok());
  }
  for (uint64_t s = 0; s < size / slice; ++s) {
    fill(expect, s);
    REQUIRE(f.rt->read(t, s * slice, buf.data(), slice).is_ok());
    REQUIRE(buf == expect);
  }
}

TEST_CASE(
    "concurrent reads and writes of disjoint ranges of one NVMe tensor never see a "
    "false checksum mismatch",
    "[nvme]") {
  // One piece (256 KiB) holds both ranges: every write rewrites the piece the reader reads.
  Fixture f(IoEngineKind::kAuto);
  const uint64_t size = 256 * 1024;
  const auto data = random_bytes(size, 21);
  const TensorId t = f.tensor("shared", size, Tier::kNvme);
  REQUIRE(f.rt->write(t, 0, data.data(), size).is_ok());
  const uint64_t half = size / 2;
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::thread writer([&] {
    for (int i = 0; i < 200 && failures == 0; ++i) {
      const auto patch = random_bytes(half, 100 + static_cast<uint64_t>(i));
      const Status s = f.rt->write(t, half, patch.data(), half);
      if (!s.is_ok() && failures++ == 0) first_failure = s.message();
    }
    stop = true;
  });
  std::vector<unsigned char> got(half);
  int reads = 0;
  while (!stop && failures == 0) {
    const Status s = f.rt->read(t, 0, got.data(), half);
    ++reads;
    if (!s.is_ok()) {
      if (failures++ == 0) first_failure = s.message();
      break;
    }
    REQUIRE(std::equal(got.begin(), got.end(), data.begin()));  // the untouched half
  }
  writer.join();
  INFO(reads << " reads; " << first_failure);
  REQUIRE(failures == 0);
}

TEST_CASE("one backing file given twice, or held by another runtime, is refused", "[nvme]") {
  ScratchDir scratch;
  const std::string file = scratch.file("tier");
  RuntimeOptions o;
  o.device.kind = DeviceKind::kHost;
  o.budgets = {8 * kMiB, 8 * kMiB, 8 * kMiB};
  o.nvme.checksums = true;
  o.nvme.paths = {file, file};
  std::shared_ptr<Runtime> rt;
  Status s = Runtime::create(o, &rt);
  INFO(s.message());
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("are the same file"));
  // Another name for the same inode (a hard link) is the same file too.
  { std::ofstream(file).put('x'); }
  const std::string link = scratch.file("tier-link");
  REQUIRE(::link(file.c_str(), link.c_str()) == 0);
  o.nvme.paths = {file, link};
  s = Runtime::create(o, &rt);
  REQUIRE(s.code() == Code::kInvalidArgument);
  REQUIRE_THAT(s.message(), Catch::Contains("are the same file"));

  // Two runtimes on one file: the second is refused while the first lives, and the first's
  // data is intact; once it is gone the file can be used again.
  o.nvme.paths = {file};
  REQUIRE(Runtime::create(o, &rt).is_ok());
  const auto data = random_bytes(64 * 1024, 22);
  TensorSpec spec;
  spec.name = "kept";
  spec.shape = {static_cast<int64_t>(data.size())};
  spec.home = Tier::kNvme;
  TensorId id = 0;
  REQUIRE(rt->register_tensor(spec, &id).is_ok());
  REQUIRE(rt->write(id, 0, data.data(), data.size()).is_ok());
  std::shared_ptr<Runtime> second;
  s = Runtime::create(o, &second);
  INFO(s.message());
  REQUIRE(s.code() == Code::kBusy);
  REQUIRE_THAT(s.message(), Catch::Contains("in use by another runtime"));
  REQUIRE(std::filesystem::exists(file));  // the refused runtime removed nothing
  std::vector<unsigned char> back(data.size());
  REQUIRE(rt->read(id, 0, back.data(), back.size()).is_ok());
  REQUIRE(back == data);
  rt.reset();
  REQUIRE(Runtime::create(o, &second).is_ok());
}

TEST_CASE(
    "io_uring registers the DRAM arena as fixed buffers only for direct DRAM transfers; the "
    "staging slots always",
    "[nvme]") {
  // Staged (the default): only the slots (2 x 4 x 256 KiB, one buffer) are ever read into or
  // written from, and registering the arena would pin all of it a second time at set-up.
  for (bool direct : {false, true}) {
    INFO("direct_dram " << direct);
    Fixture f(IoEngineKind::kUring, 1, 256 * 1024, 64 * kMiB, 64 * kMiB, 64 * kMiB, direct);
    const NvmeTier* nvme = f.rt->nvme();
    REQUIRE(nvme != nullptr);
    if (nvme->engine_name() != std::string("io_uring") ||
        nvme->engine_reason().find("not registered") != std::string::npos) {
      WARN("io_uring or its fixed buffers unavailable here: " << nvme->engine_reason());
      continue;
    }
    INFO(nvme->engine_reason());
    CHECK(nvme->engine_reason().find(direct
                                         ? "; 2 fixed buffer(s) registered"
                                         : "; 1 fixed buffer(s) registered") != std::string::npos);
    // Both modes still move DRAM <-> NVMe correctly.
    const uint64_t size = 3 * kMiB + 7;
    auto data = random_bytes(size, 31);
    const TensorId t = f.tensor("fixed", size, Tier::kDram, &data);
    REQUIRE(f.move(t, Tier::kNvme).is_ok());
    REQUIRE(f.move(t, Tier::kDram).is_ok());
    REQUIRE(f.read(t, size) == data);
  }
}
