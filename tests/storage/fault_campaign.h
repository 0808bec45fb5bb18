// The fault campaigns' harness (test_fault_campaign*.cpp; the campaigns themselves are described
// there): the injector on the storage engine's transfers, the engine/DRAM-path variants, the
// runtime and tensor helpers, Scenario (the steps a caller takes), and the driver that fails
// each transfer of a scenario in turn and checks what it left.
#pragma once

#include <catch2/catch.hpp>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <thread>

#include "runtime/checkpoint/atomic_directory.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/optimizer/optimizer.h"
#include "runtime/runtime.h"
#include "runtime/stream/executor.h"
#include "support/scratch_dir.h"

namespace fault_campaign {

using namespace strata;
using strata_test::ScratchDir;

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kBlock = 64 * kKiB;  // stripe unit: tensors below span 1-5 pieces

enum class Fault { kEnospc, kEio, kShort };
inline const Fault kFaults[] = {Fault::kEnospc, Fault::kEio, Fault::kShort};

inline const char* fault_name(Fault f) {
  return f == Fault::kEnospc ? "ENOSPC" : f == Fault::kEio ? "EIO" : "short";
}

// Sees every transfer of one runtime's storage engine: counts them, and alters the target-th.
struct Injector {
  std::atomic<uint64_t> calls{0};
  std::atomic<uint64_t> target{0};  // 1-based; 0: none
  Fault fault = Fault::kEio;
  std::atomic<bool> fired{false};
  std::atomic<int> fired_op{-1};

  int64_t filter(IoOp op, int64_t result) {
    const uint64_t n = calls.fetch_add(1) + 1;
    if (n != target.load()) return result;
    fired = true;
    fired_op = static_cast<int>(op);
    switch (fault) {
      case Fault::kEnospc:
        return -ENOSPC;
      case Fault::kEio:
        return -EIO;
      case Fault::kShort:  // half of it, still 512-aligned: the engine must resume the rest
        return result > 1024 ? result / 2 / 512 * 512 : result;
    }
    return result;
  }
  void disarm() { target = 0; }
};

struct Variant {
  IoEngineKind engine;
  bool direct;
};
inline std::string variant_name(const Variant& v) {
  return std::string(v.engine == IoEngineKind::kUring ? "io_uring" : "posix") +
         (v.direct ? ", direct" : ", staged");
}

inline std::shared_ptr<Runtime> make_runtime(const ScratchDir& scratch, const Variant& v,
                                             const std::shared_ptr<Injector>& injector) {
  RuntimeOptions o;
  o.device.kind = DeviceKind::kHost;
  o.budgets = {4ull << 20, 4ull << 20, 1ull << 20};  // planning reads all free NVMe
  o.dram.threads = 1;
  o.nvme.paths = {scratch.file("nvme0"), scratch.file("nvme1")};  // striped over two files
  o.nvme.engine = v.engine;
  o.nvme.block_size = kBlock;
  o.nvme.queue_depth = 2;  // fewer staging slots than pieces: the pipelines wrap around
  o.nvme.checksums = true;
  o.nvme.direct_dram = v.direct;
  o.nvme.fault_hook = [injector](IoOp op, int, uint64_t, uint64_t, int64_t result) {
    return injector->filter(op, result);
  };
  std::shared_ptr<Runtime> rt;
  const Status s = Runtime::create(o, &rt);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return rt;
}

inline std::vector<unsigned char> pattern(uint64_t n, uint64_t seed) {
  std::vector<unsigned char> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

// Small finite floats (grads, weights) as bytes.
inline std::vector<unsigned char> float_pattern(uint64_t count, uint64_t seed) {
  std::vector<float> f(count);
  const auto bits = pattern(count, seed);
  for (uint64_t i = 0; i < count; ++i) f[i] = (static_cast<float>(bits[i]) - 127.5f) / 512.f;
  std::vector<unsigned char> out(count * sizeof(float));
  std::memcpy(out.data(), f.data(), out.size());
  return out;
}

inline TensorId add_tensor(Runtime& rt, const std::string& name, uint64_t bytes, Tier home,
                           Role role = Role::kOther, DType dtype = DType::kU8) {
  TensorSpec spec;
  spec.name = name;
  spec.dtype = dtype;
  spec.shape = {static_cast<int64_t>(bytes / dtype_size(dtype))};
  spec.role = role;
  spec.home = home;
  TensorId id = 0;
  const Status s = rt.register_tensor(spec, &id);
  INFO(s.message());
  REQUIRE(s.is_ok());
  return id;
}

inline std::vector<unsigned char> read_all(Runtime& rt, TensorId id) {
  TensorRecord r;
  REQUIRE(rt.info(id, &r).is_ok());
  std::vector<unsigned char> out(r.nbytes);
  const Status s = rt.read(id, 0, out.data(), out.size());
  INFO("reading '" << r.spec.name << "': " << s.message());
  REQUIRE(s.is_ok());
  return out;
}

// Byte-for-byte equality that names the first difference (Catch would print both vectors).
inline std::string difference(const std::vector<unsigned char>& got,
                              const std::vector<unsigned char>& want) {
  if (got.size() != want.size()) {
    return "sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  }
  const auto m = std::mismatch(got.begin(), got.end(), want.begin());
  if (m.first == got.end()) return "";
  return "first difference at byte " + std::to_string(m.first - got.begin()) + " of " +
         std::to_string(got.size());
}
#define REQUIRE_SAME(got, want) REQUIRE(difference((got), (want)) == "")

inline Tier tier_of(Runtime& rt, TensorId id) {
  TensorRecord r;
  REQUIRE(rt.info(id, &r).is_ok());
  return r.tier;
}

inline Status move(Runtime& rt, TensorId id, Tier dst) {
  std::shared_ptr<Completion> done;
  STRATA_RETURN_IF_ERROR(rt.move(id, dst, nullptr, &done));
  return done->wait(-1);
}

inline std::size_t count_fds() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// The process's threads, less io_uring's kernel workers ("iou-wrk-N"), which the kernel
// starts and retires on its own schedule.
inline std::size_t count_threads() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
      std::string name;
      std::getline(comm, name);
      if (name.rfind("iou-", 0) != 0) ++n;
    }
    closedir(d);
  }
  return n;
}

// Aborts the process if `body` runs longer than `seconds`: a hang is a failure, not a stuck job.
inline void with_watchdog(int seconds, const std::string& what, const std::function<void()>& body) {
  std::promise<void> finished;
  std::thread watchdog([seconds, what, f = finished.get_future()]() mutable {
    if (f.wait_for(std::chrono::seconds(seconds)) == std::future_status::timeout) {
      std::fprintf(stderr, "WATCHDOG: %s still running after %d s\n", what.c_str(), seconds);
      std::abort();
    }
  });
  struct Stop {
    std::promise<void>& p;
    std::thread& t;
    ~Stop() {
      p.set_value();
      t.join();
    }
  } stop{finished, watchdog};
  body();
}

// One thing a caller does. After `run` failed: `recover` is what the caller does before trying
// again (abandon a step...), `check` that the data the step did not set out to change survived.
struct Step {
  std::string name;
  std::function<Status()> run;
  std::function<void()> recover;
  std::function<void()> check;
};

class Scenario {
 public:
  virtual ~Scenario() = default;
  virtual std::vector<Step> steps() = 0;
  // Every byte the scenario owns, and where it lives: equal to the clean run's at the end.
  virtual std::vector<unsigned char> snapshot() = 0;
  // Tier usage at the end: no extent or block leaked by a failure.
  std::vector<uint64_t> usage() {
    std::vector<uint64_t> u;
    for (Tier t : {Tier::kHbm, Tier::kDram, Tier::kNvme}) u.push_back(rt->tier_usage(t).used);
    return u;
  }

  ScratchDir scratch;
  std::shared_ptr<Runtime> rt;
};

using Factory = std::function<std::unique_ptr<Scenario>(const Variant&, std::shared_ptr<Injector>)>;

// ----- the campaign driver --------------------------------------------------------------------

struct Tally {
  uint64_t points = 0;                    // transfers of a clean run
  std::map<Fault, uint64_t> runs;         // scenario runs per fault
  std::map<Fault, uint64_t> failed;       // runs whose step failed cleanly, retried, recovered
  std::map<std::string, uint64_t> where;  // failed steps by name
};

// STRATA_FAULT_CAMPAIGN: unset, the default run; "full", every fault at every transfer on all
// four variants; "full:N", the same on variant N of kAllVariants only (the soak rotates N).
inline std::string campaign_mode() {
  const char* e = std::getenv("STRATA_FAULT_CAMPAIGN");
  return e != nullptr ? e : "";
}
inline bool full_campaign() {
  return campaign_mode().rfind("full", 0) == 0;
}

// One run with transfer `k` altered by `fault`.
inline void run_injected(const Factory& factory, const Variant& v, uint64_t k, Fault fault,
                         const std::vector<unsigned char>& golden,
                         const std::vector<uint64_t>& usage, Tally* tally) {
  auto injector = std::make_shared<Injector>();
  injector->target = k;
  injector->fault = fault;
  auto scenario = factory(v, injector);
  int failures = 0;
  std::string failed_steps;
  for (Step& step : scenario->steps()) {
    const Status s = step.run();
    if (s.is_ok()) continue;
    ++failures;
    failed_steps += "'" + step.name + "': " + s.message() + "; ";
    INFO("step '" << step.name << "' failed: " << s.message());
    REQUIRE(injector->fired);
    REQUIRE(fault != Fault::kShort);  // a short transfer is resumed, never an error
    REQUIRE(s.code() == Code::kIo);
    const int err = fault == Fault::kEnospc ? ENOSPC : EIO;
    REQUIRE_THAT(s.message(), Catch::Contains(std::strerror(err)) &&
                                  Catch::Contains("(errno " + std::to_string(err) + ")") &&
                                  Catch::Contains(scenario->scratch.path()));
    injector->disarm();
    if (step.recover) step.recover();
    if (step.check) step.check();
    const Status again = step.run();
    INFO("retry: " << again.message());
    REQUIRE(again.is_ok());
    ++tally->where[step.name];
  }
  INFO("failed steps: " << failed_steps);
  REQUIRE(injector->fired);
  // An injected error is reported exactly once, by the step whose transfer it hit.
  REQUIRE(failures == (fault == Fault::kShort ? 0 : 1));
  REQUIRE_SAME(scenario->snapshot(), golden);
  REQUIRE(scenario->usage() == usage);
  ++tally->runs[fault];
  if (failures > 0) ++tally->failed[fault];
}

inline Tally run_campaign(const std::string& name, const Factory& factory, const Variant& v) {
  INFO("campaign " << name << " (" << variant_name(v) << ")");
  Tally tally;
  std::vector<unsigned char> golden;
  std::vector<uint64_t> usage;
  {
    auto injector = std::make_shared<Injector>();
    auto scenario = factory(v, injector);
    for (Step& step : scenario->steps()) {
      const Status s = step.run();
      INFO("clean run, step '" << step.name << "': " << s.message());
      REQUIRE(s.is_ok());
    }
    tally.points = injector->calls;
    golden = scenario->snapshot();
    usage = scenario->usage();
  }
  REQUIRE(tally.points > 0);
  // Counted after a whole run, so that threads started once per process (ThreadSanitizer's
  // background thread) are already there.
  const std::size_t fds = count_fds();
  const std::size_t threads = count_threads();
  for (uint64_t k = 1; k <= tally.points; ++k) {
    for (Fault fault : kFaults) {
      // The default run gives each transfer one of the faults, in turn (each fault hits every
      // third transfer, and every step of the scenario); the full campaign gives it all three.
      if (!full_campaign() && fault != kFaults[k % 3]) continue;
#if defined(__SANITIZE_THREAD__)
      // ThreadSanitizer slows each run ~10x: its default run takes every other transfer (the
      // release and ASan runs take them all; the soak's full sweeps run under TSan too).
      if (!full_campaign() && k % 2 == 0) continue;
#endif
      INFO("transfer " << k << " of " << tally.points << ": " << fault_name(fault));
      with_watchdog(120, name + " transfer " + std::to_string(k) + " " + fault_name(fault),
                    [&] { run_injected(factory, v, k, fault, golden, usage, &tally); });
    }
  }
  // Every runtime was destroyed whole: its files, io_uring and threads are gone.
  REQUIRE(count_fds() == fds);
  REQUIRE(count_threads() == threads);
  std::printf(
      "fault campaign %-11s (%s): %3llu transfers; ENOSPC %llu/%llu, EIO %llu/%llu "
      "failed cleanly and recovered, short %llu/%llu resumed; failures by step:",
      name.c_str(), variant_name(v).c_str(), static_cast<unsigned long long>(tally.points),
      static_cast<unsigned long long>(tally.failed[Fault::kEnospc]),
      static_cast<unsigned long long>(tally.runs[Fault::kEnospc]),
      static_cast<unsigned long long>(tally.failed[Fault::kEio]),
      static_cast<unsigned long long>(tally.runs[Fault::kEio]),
      static_cast<unsigned long long>(tally.runs[Fault::kShort] - tally.failed[Fault::kShort]),
      static_cast<unsigned long long>(tally.runs[Fault::kShort]));
  for (const auto& [step, n] : tally.where) {
    std::printf(" %s %llu;", step.c_str(), static_cast<unsigned long long>(n));
  }
  std::printf("\n");
  return tally;
}

template <typename S>
Factory factory() {
  return [](const Variant& v, std::shared_ptr<Injector> injector) -> std::unique_ptr<Scenario> {
    return std::make_unique<S>(v, std::move(injector));
  };
}

inline const Variant kAllVariants[] = {{IoEngineKind::kUring, false},
                                       {IoEngineKind::kUring, true},
                                       {IoEngineKind::kPosix, false},
                                       {IoEngineKind::kPosix, true}};

// The default run gives each scenario one variant, so that together they use both engines and
// both DRAM paths; the full campaign runs each on all four.
inline std::vector<Variant> variants(Variant fallback) {
  const std::string mode = campaign_mode();
  if (mode.rfind("full:", 0) == 0) return {kAllVariants[std::stoul(mode.substr(5)) % 4]};
  if (full_campaign()) return {std::begin(kAllVariants), std::end(kAllVariants)};
  return {fallback};
}

}  // namespace fault_campaign
