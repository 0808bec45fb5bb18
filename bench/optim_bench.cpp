// strata-bench optim: the optimizer's update rate through the C ABI (strata_optimizer_step over
// DRAM tensors, the same kernels an executor-driven update runs), the memory bandwidth it
// implies next to a STREAM triad measured in the same run with the same thread count, and
// torch.optim.AdamW on the CPU (foreach and fused, fp32, same sizes) where torch is installed;
// then Adam, SGD (momentum), Lion and Adagrad, each next to its torch peer the same way.
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
// keeps the param as its own master, so its bytes per param are Strata's fp32 case). Each
// optimizer as its Strata counterpart is configured (SGD with momentum 0.9); torch has no Lion,
// so Lion's peer is lion-pytorch's update written in torch's foreach ops (one call per state
// for all params: the fastest way torch's own CPU kernels run it).
const char* kTorchPeer = R"PY(
import json, sys, time
try:
    import torch
except ImportError as e:
    print(json.dumps({"error": "torch not importable: %s" % e})); sys.exit(0)
n, chunk, threads, reps = (int(a) for a in sys.argv[1:5])
kinds = sys.argv[5].split(",")
torch.set_num_threads(threads)
torch.manual_seed(0)
sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3

class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **_):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            gs = [p.grad for p in ps]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in ps]
            b1, b2 = g["betas"]
            torch._foreach_mul_(ps, 1 - g["lr"] * g["weight_decay"])
            u = torch._foreach_lerp(ms, gs, 1 - b1)
            torch._foreach_sign_(u)
            torch._foreach_add_(ps, u, alpha=-g["lr"])
            torch._foreach_lerp_(ms, gs, 1 - b2)

makers = {
    "adamw": lambda **kw: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, **kw),
    "adam": lambda **kw: torch.optim.Adam(params, lr=1e-3, **kw),
    "sgd": lambda **kw: torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw),
    "adagrad": lambda **kw: torch.optim.Adagrad(params, lr=1e-2, **kw),
    "lion": lambda **kw: Lion(params, lr=1e-4, **kw),
}
out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
for kind in kinds:
    for mode in ("foreach", "fused"):
        if kind == "lion" and mode == "fused":
            continue
        try:
            opt = makers[kind](**({} if kind == "lion" else {mode: True}))
            opt.step()  # state allocated here, outside the timing
            times = []
            for _ in range(reps):
                t0 = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t0)
            times.sort()
            out[kind + "_" + mode] = n / times[len(times) // 2]
            del opt
        except Exception as e:  # fused kernels on the CPU need a recent torch
            out[kind + "_" + mode + "_error"] = str(e)
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

// The optimizers measured: Strata's kind, its name in the report and the peer's, and the
// bytes of moments it keeps per parameter (SGD with momentum 0.9: a buffer).
struct Kind {
  strata_optimizer_kind_t kind;
  const char* name;
  uint64_t moment_bytes;
};
constexpr Kind kAdamW{STRATA_OPTIMIZER_ADAMW, "adamw", 8};
constexpr Kind kOthers[] = {{STRATA_OPTIMIZER_ADAM, "adam", 8},
                            {STRATA_OPTIMIZER_SGD, "sgd", 4},
                            {STRATA_OPTIMIZER_LION, "lion", 4},
                            {STRATA_OPTIMIZER_ADAGRAD, "adagrad", 4}};

// An optimizer of `kind` over `n` elements in params of `chunk`: weights and grads of `dtype`
// (f32 or bf16), bf16 masters kept whole or split (STRATA_MASTER_*).
Run time_strata(uint64_t n, uint64_t chunk, strata_dtype_t dtype, unsigned threads, int reps,
                uint32_t master_layout = STRATA_MASTER_SEPARATE, const Kind& kind = kAdamW) {
  const bool bf16 = dtype == STRATA_DTYPE_BF16;
  const uint64_t es = bf16 ? 2 : 4;
  // master (bf16 only: 4 bytes, 2 split), moments
  const uint64_t state =
      kind.moment_bytes + (bf16 ? (master_layout == STRATA_MASTER_SPLIT ? 2 : 4) : 0);
  strata_runtime_config_t c;
  strata_runtime_config_init(&c);
  c.device_backend = STRATA_DEVICE_BACKEND_HOST;  // host memory only: no GPU needed
  c.hbm_budget_bytes = 64ull << 20;
  c.dram_budget_bytes = n * (2 * es + state) + (256ull << 20);
  strata_capabilities_t caps;
  strata_runtime_t* rt = open_runtime(c, &caps);
  strata_optimizer_config_t oc;
  strata_optimizer_config_init(kind.kind, &oc);
  if (kind.kind == STRATA_OPTIMIZER_SGD) oc.momentum = 0.9f;
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
    strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, t[0], t[1], 0, master_layout,
                          STRATA_GRAD_SUM_ACCUMULATOR};
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
  // The other kinds: fp32 (the case torch's peer runs) and bf16 weights with fp32 masters.
  std::vector<Run> others;
  for (const Kind& k : kOthers) {
    progress(std::string("Strata ") + k.name + ", fp32 and bf16 weights and grads");
    const auto t = static_cast<unsigned>(threads_opt);
    others.push_back(time_strata(n, chunk, STRATA_DTYPE_F32, t, reps, STRATA_MASTER_SEPARATE, k));
    const Run b = time_strata(n, chunk, STRATA_DTYPE_BF16, t, reps, STRATA_MASTER_SEPARATE, k);
    report->add(Result{std::string(k.name) + "_bf16_params", b.params_per_second / 1e9, "Gparam/s",
                       "", 0, 0, "bf16 weights+grads, fp32 master"});
    report->add(Result{std::string(k.name) + "_fp32_params", others.back().params_per_second / 1e9,
                       "Gparam/s", "", 0, 0, "fp32 weights (own masters) + grads"});
  }
  if (no_torch) return 0;
  progress("torch.optim on the CPU (foreach, fused): AdamW, Adam, SGD, Lion, Adagrad");
  std::string kinds = kAdamW.name;
  for (const Kind& k : kOthers) kinds += std::string(",") + k.name;
  const std::string out =
      run_command({python, "-c", kTorchPeer, std::to_string(n), std::to_string(chunk),
                   std::to_string(fp32.threads), std::to_string(reps), kinds});
  const double foreach = json_number(out, "adamw_foreach"), fused = json_number(out, "adamw_fused");
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
  for (std::size_t i = 0; i < others.size(); ++i) {
    const std::string name = kOthers[i].name;
    for (const char* mode : {"foreach", "fused"}) {
      const double peer = json_number(out, name + "_" + mode);
      if (peer <= 0) continue;  // no fused kernel for it (Lion: none in torch)
      report->add_vs(name + "_fp32_vs_torch_" + mode, others[i].params_per_second / 1e9, "Gparam/s",
                     "torch " + name + " " + mode, peer / 1e9, false,
                     name == "lion" ? "peer: lion-pytorch's update in torch foreach ops"
                                    : "same threads, same sizes");
    }
  }
  return 0;
}

}  // namespace strata_bench
