// strata-bench optim: the optimizer's update rate through the C ABI (strata_optimizer_step over
// DRAM tensors, the same kernels an executor-driven update runs), the memory bandwidth it
// implies next to a STREAM triad measured in the same run with the same thread count, and
// torch.optim.AdamW on the CPU (foreach and fused, fp32, same sizes) where torch is installed.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_options.h"
#include "bench_report.h"
#include "bench_strata.h"
#include "host_triad.h"
#include "strata/strata.h"

namespace strata_bench {
namespace {

using Clock = std::chrono::steady_clock;

// The torch peer, run as `python3 -c`: params of the same sizes, fp32 params and grads (torch
// keeps the param as its own master, so its bytes per param are Strata's fp32 case).
const char* kTorchPeer = R"PY(
import json, sys, time
try:
    import torch
except ImportError as e:
    print(json.dumps({"error": "torch not importable: %s" % e})); sys.exit(0)
n, chunk, threads, reps = (int(a) for a in sys.argv[1:5])
torch.set_num_threads(threads)
torch.manual_seed(0)
sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
for mode in ("foreach", "fused"):
    try:
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **{mode: True})
        opt.step()  # state allocated here, outside the timing
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t0)
        times.sort()
        out[mode] = n / times[len(times) // 2]
        del opt
    except Exception as e:  # fused AdamW on the CPU needs a recent torch
        out[mode + "_error"] = str(e)
print(json.dumps(out))
)PY";

std::string run_command(const std::vector<std::string>& argv) {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  close(fds[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "";
  return out;
}

// The number after "key": in a flat JSON object, or -1.
double json_number(const std::string& json, const std::string& key) {
  const auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::strtod(json.c_str() + at + key.size() + 3, nullptr);
}

struct Run {
  double params_per_second = 0;
  unsigned threads = 0;
  std::string isa, binding;
};

// AdamW over `n` elements in params of `chunk`: weights and grads of `dtype` (f32 or bf16),
// bf16 masters kept whole or split (STRATA_MASTER_*).
Run time_strata(uint64_t n, uint64_t chunk, strata_dtype_t dtype, unsigned threads, int reps,
                uint32_t master_layout = STRATA_MASTER_SEPARATE) {
  const bool bf16 = dtype == STRATA_DTYPE_BF16;
  const uint64_t es = bf16 ? 2 : 4;
  // master (bf16 only: 4 bytes, 2 split), m, v
  const uint64_t state = 8 + (bf16 ? (master_layout == STRATA_MASTER_SPLIT ? 2 : 4) : 0);
  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = STRATA_DEVICE_BACKEND_HOST;  // host memory only: no GPU needed
  c.hbm_budget_bytes = 64ull << 20;
  c.dram_budget_bytes = n * (2 * es + state) + (256ull << 20);
  strata_capabilities_t caps;
  strata_runtime_t* rt = open_runtime(c, &caps);
  strata_optimizer_config_t oc;
  strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &oc);
  oc.threads = threads;
  strata_optimizer_t* opt = nullptr;
  check(strata_optimizer_create(rt, &oc, &opt), "optimizer");
  std::mt19937 rng(1);
  std::vector<unsigned char> fill;
  for (uint64_t off = 0, i = 0; off < n; off += chunk, ++i) {
    const int64_t len = static_cast<int64_t>(std::min(chunk, n - off));
    strata_tensor_t* t[2];
    for (int k = 0; k < 2; ++k) {
      const std::string name = "p" + std::to_string(i) + (k ? ".grad" : "");
      strata_tensor_desc_t d{};
      d.struct_size = STRATA_TENSOR_DESC_STRUCT_SIZE;
      d.name = name.c_str();
      d.dtype = dtype;
      d.ndim = 1;
      d.shape = &len;
      d.role = k ? STRATA_ROLE_GRAD : STRATA_ROLE_WEIGHT;
      d.home_tier = STRATA_TIER_DRAM;
      check(strata_tensor_register(rt, &d, &t[k]), "register");
      // Small random values in either dtype (the top bytes of small floats): no denormals.
      fill.resize(static_cast<std::size_t>(len) * es);
      for (std::size_t b = 0; b < fill.size(); ++b) {
        fill[b] = static_cast<unsigned char>(b % es == es - 1 ? 0x3c : rng());
      }
      check(strata_tensor_write(rt, t[k], 0, fill.data(), fill.size()), "write");
    }
    strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, t[0], t[1], 0, master_layout};
    check(strata_optimizer_add_param(opt, &p), "add_param");
  }
  check(strata_optimizer_step(opt), "warm-up step");
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    check(strata_optimizer_step(opt), "step");
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  strata_optimizer_stats_t s{};
  s.struct_size = STRATA_OPTIMIZER_STATS_STRUCT_SIZE;
  check(strata_optimizer_get_stats(opt, &s), "stats");
  Run run{static_cast<double>(n) / median(times), s.threads, s.isa, s.binding};
  check(strata_optimizer_destroy(opt), "optimizer destroy");
  check(strata_runtime_destroy(rt), "runtime destroy");
  return run;
}

}  // namespace

int run_optim(const Options& opt, Report* report) {
  const uint64_t n = opt.bytes("params", 256ull << 20);
  const uint64_t chunk = opt.bytes("chunk", 16ull << 20);
  const long threads_opt = opt.integer("threads", 0);
  const int reps = static_cast<int>(opt.integer("reps", 5));
  const std::string python = opt.str("python", "python3");
  const bool no_torch = opt.flag("no-torch");
  if (n < 1024 || chunk < 1024 || reps < 1) {
    throw std::invalid_argument("--params >= 1K, --chunk >= 1K, --reps >= 1");
  }
  // Bytes each update names per parameter (STREAM's convention, as the triad's): fp32 masters,
  // m and v read and written (24), plus the grad read and the working copy written: bf16 both
  // (4) = 28; or fp32 weights that are their own masters and fp32 grads (4) = 28 too.
  constexpr double kBytesPerParam = 28.0;

  progress("Strata AdamW, bf16 weights and grads, fp32 masters");
  const Run bf16 =
      time_strata(n, chunk, STRATA_DTYPE_BF16, static_cast<unsigned>(threads_opt), reps);
  progress("Strata AdamW, bf16 weights and grads, split fp32 masters");
  const Run split = time_strata(n, chunk, STRATA_DTYPE_BF16, static_cast<unsigned>(threads_opt),
                                reps, STRATA_MASTER_SPLIT);
  progress("Strata AdamW, fp32 weights and grads");
  const Run fp32 =
      time_strata(n, chunk, STRATA_DTYPE_F32, static_cast<unsigned>(threads_opt), reps);
  report->device = "host memory, " + std::to_string(bf16.threads) + " threads (" + bf16.binding +
                   "), " + bf16.isa;
  progress("STREAM triad, " + std::to_string(bf16.threads) + " threads");
  const double triad = triad_gbps(std::max<uint64_t>(n * 4, 1ull << 30), bf16.threads, 5);
  report->add(Result{"adamw_bf16_params", bf16.params_per_second / 1e9, "Gparam/s", "", 0, 0,
                     "bf16 weights+grads, fp32 master/m/v"});
  report->add_vs("adamw_bf16_bandwidth", bf16.params_per_second * kBytesPerParam / 1e9, "GB/s",
                 "STREAM triad", triad, false, "28 B/param");
  // A split master's update names 26 bytes per parameter: the weight and the low halves read
  // and written (8) instead of the master read and written and the weight written (10).
  report->add_vs("adamw_bf16_split_params", split.params_per_second / 1e9, "Gparam/s",
                 "whole fp32 masters", bf16.params_per_second / 1e9, false,
                 "bf16 weights+grads, split master (2 B) + m/v");
  report->add_vs("adamw_bf16_split_bandwidth", split.params_per_second * 26.0 / 1e9, "GB/s",
                 "STREAM triad", triad, false, "26 B/param");
  report->add(Result{"adamw_fp32_params", fp32.params_per_second / 1e9, "Gparam/s", "", 0, 0,
                     "fp32 weights (own masters) + grads"});
  report->add_vs("adamw_fp32_bandwidth", fp32.params_per_second * kBytesPerParam / 1e9, "GB/s",
                 "STREAM triad", triad, false, "28 B/param");
  if (no_torch) return 0;
  progress("torch.optim.AdamW on the CPU (foreach, fused)");
  const std::string out =
      run_command({python, "-c", kTorchPeer, std::to_string(n), std::to_string(chunk),
                   std::to_string(fp32.threads), std::to_string(reps)});
  const double foreach = json_number(out, "foreach"), fused = json_number(out, "fused");
  if (foreach <= 0) {
    report->add(Result{"torch_adamw", 0, "", "", 0, 0,
                       "torch peer not run: " + (out.empty() ? python + " failed" : out)});
    return 0;
  }
  report->add_vs("adamw_fp32_vs_torch_foreach", fp32.params_per_second / 1e9, "Gparam/s",
                 "torch AdamW foreach", foreach / 1e9, false, "same threads, same sizes");
  if (fused > 0) {
    report->add_vs("adamw_fp32_vs_torch_fused", fp32.params_per_second / 1e9, "Gparam/s",
                   "torch AdamW fused", fused / 1e9, false, "");
  }
  return 0;
}

}  // namespace strata_bench
