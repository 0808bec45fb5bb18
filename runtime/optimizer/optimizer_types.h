// The optimizer's value types: its kinds and config, a parameter's grad and group
// hyperparameters as a framework sees them, its stats and checkpoint counters. They carry the C
// ABI's values (strata.h) and checkpoints' records; optimizer.h declares the service that uses
// them.
#pragma once

#include <cstdint>
#include <string>

namespace strata {

// strata.h STRATA_OPTIMIZER_* (append only).
enum class OptimizerKind : int32_t { kAdamW = 0, kSgd = 1, kAdam = 2, kLion = 3, kAdagrad = 4 };

// The state tensors a kind keeps beside the master: their name suffixes, null where it keeps
// none. The one copy of the rule: add_param allocates these and layout_sizes counts them.
// exp_avg: AdamW/Adam/Lion m, SGD's momentum buffer (momentum > 0); exp_avg_sq: AdamW/Adam v,
// Adagrad's sum.
struct StateSet {
  const char* exp_avg = nullptr;
  const char* exp_avg_sq = nullptr;
};
StateSet state_set(OptimizerKind kind, float momentum);
// Whether `kind` is an OptimizerKind (the C ABI checks kinds it is given with it).
bool known_kind(int32_t kind);
// "adamw", "sgd", "adam", "lion", "adagrad": as checkpoints record the kind.
const char* kind_name(OptimizerKind kind);

// Where params' fp32 masters and moments live (strata.h STRATA_STATE_*).
enum class StatePlacement : uint32_t { kInDram = 0, kPlanned = 1, kOnNvme = 2 };

// The defaults are PyTorch's (torch.optim.AdamW, SGD, Adam, Adagrad; Lion: lion-pytorch's
// betas and weight decay) and the only copy of them: strata_optimizer_config_init returns
// OptimizerConfig{.kind = kind}. Members may use the kind.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = kind == OptimizerKind::kLion ? 1e-4f : kind == OptimizerKind::kAdagrad ? 1e-2f : 1e-3f;
  float beta1 = 0.9f, beta2 = kind == OptimizerKind::kLion ? 0.99f : 0.999f;
  float eps = kind == OptimizerKind::kAdagrad ? 1e-10f : 1e-8f;
  // AdamW and Lion: decoupled; SGD, Adam and Adagrad: L2 (added to the grad)
  float weight_decay = kind == OptimizerKind::kAdamW ? 1e-2f : 0.f;
  float momentum = 0.f, dampening = 0.f;
  bool nesterov = false;
  float max_grad_norm = 0.f;  // 0: no clipping
  float loss_scale = 1.f;     // grads arrive multiplied by it
  bool dynamic_loss_scale = false;
  float growth_factor = 2.f, backoff_factor = 0.5f;
  uint32_t growth_interval = 2000;
  uint32_t accumulation_steps = 1;  // executor steps per update (grads summed in fp32)
  uint32_t threads = 0;             // 0: the GPU node's CPUs less one
  bool explicit_updates = false;    // updates only from step(); grads held per parameter
  StatePlacement state_placement = StatePlacement::kInDram;
  uint64_t nvme_staging_bytes = 0;  // 0: auto (see strata.h)
};

// A parameter's grad in explicit mode, as a framework sees its `p.grad`.
struct GradInfo {
  bool has_grad = false;
  double sum_squares = 0;  // of the grad's values, scale applied
  uint64_t step = 0;       // updates this parameter received (AdamW's t for it)
};

// A group's hyperparameters, read at each update that starts after they are set (torch's
// optimizers read their param_groups at every step: a scheduler such as OneCycleLR changes
// betas as well as lr). beta1, beta2 and eps are AdamW's and Adam's; Lion reads the betas,
// Adagrad eps; SGD reads lr and weight_decay.
struct GroupHyperparams {
  float lr = 0.f;
  float weight_decay = 0.f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
};

enum class StateKind : int32_t {
  kMaster = 0,
  kExpAvg = 1,
  kExpAvgSq = 2,
  kGradAccum = 3,
  kMasterLow = 4,  // a split master's low halves (MasterLayout::kSplit)
};

// How a bf16 weight's fp32 master is kept (strata.h STRATA_MASTER_*). kSplit: the weight is the
// master's upper half (rounded to nearest even) and the optimizer keeps only a signed 16-bit
// remainder, `<w>.master_low`: 2 bytes per parameter instead of 4, and the update writes no
// separate working copy (kernels_impl.h's store_split says what is exact and what is not).
enum class MasterLayout : uint32_t { kSeparate = 0, kSplit = 1 };

// Where explicit mode sums a param's grads of several backward passes (strata.h
// STRATA_GRAD_SUM_*). kAccumulator: in an fp32 `<w>.grad_accum` (plan_accumulators), the grad
// tensor taking each pass's grad. kInPlace: the grad tensor, fp32 in HBM, is the sum: the
// backward load zero-fills it only when the param holds no grad, and the framework adds each
// pass's grad into it (optimizer_sums.cpp).
enum class GradSum : uint32_t { kAccumulator = 0, kInPlace = 1 };

struct OptimizerStats {
  uint64_t step = 0;           // updates applied (AdamW's t)
  uint64_t skipped_steps = 0;  // non-finite grads
  uint64_t micro_step = 0;     // executor steps into the current accumulation
  double last_grad_norm = -1;  // of the unscaled grads, when it was computed (clipping, dynamic)
  float loss_scale = 1.f;
  uint64_t params = 0;
  uint64_t elements = 0;
  uint64_t state_bytes = 0;   // DRAM the optimizer allocated
  double update_seconds = 0;  // time the pool spent updating (all jobs)
  uint32_t threads = 0;
  std::string isa;
  std::string binding;
  uint64_t nvme_state_bytes = 0;
  uint64_t nvme_state_params = 0;
  uint64_t nvme_state_layers = 0;
  uint64_t staging_bytes = 0;
  uint32_t staging_slots = 0;
  uint64_t nvme_read_bytes = 0;
  uint64_t nvme_write_bytes = 0;
  double stage_wait_seconds = 0;
};

// What a checkpoint carries besides the tensors.
struct OptimizerCounters {
  uint64_t step = 0;
  uint64_t skipped_steps = 0;
  float loss_scale = 1.f;
  uint32_t growth_tracker = 0;
};

}  // namespace strata
