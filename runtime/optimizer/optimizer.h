// Optimizer: the training state beside the streamed weights, and its update. Per trainable
// weight it keeps an fp32 master (the weight itself when that is fp32) and the optimizer's
// state (AdamW m and v, or SGD momentum) as runtime tensors in DRAM, and it writes the working
// copy the executor streams to the GPU from the master.
//
// Attached to an executor, each layer's update runs on a NUMA-local thread pool as soon as its
// grads have landed in DRAM, overlapped with the backward pass of the layers below; the next
// step's load of that layer waits for it (ExecutorHooks). Clipping and dynamic loss scaling
// need every grad before any update: then the grads' norms are taken as they land (during
// backward) and the updates run in forward order once the last norm is in, overlapped with the
// next step's forward pass instead. Without an executor, step() updates everything at once.
//
// In explicit mode (a framework such as PyTorch owns the training loop's semantics) executor
// steps only deliver grads: each parameter holds its grad the way torch's `p.grad` does (none,
// zeros, the landed grad, or an fp32 sum of several backward passes), which the framework can
// read, measure, scale and zero; step() then queues every held grad's update, in forward
// order, overlapped with the next step's forward pass exactly as above.
//
// Thread-safe: one mutex guards the bookkeeping; the update kernels run outside it.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "runtime/executor_hooks.h"
#include "runtime/optimizer/kernels.h"
#include "runtime/optimizer/worker_pool.h"
#include "runtime/runtime.h"

namespace strata {

class Executor;

enum class OptimizerKind : int32_t { kAdamW = 0, kSgd = 1 };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.f;
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
};

// A parameter's grad in explicit mode, as a framework sees its `p.grad`.
struct GradInfo {
  bool has_grad = false;
  double sum_squares = 0;  // of the grad's values, scale applied
  uint64_t step = 0;       // updates this parameter received (AdamW's t for it)
};

struct GroupHyperparams {
  float lr = 0.f;
  float weight_decay = 0.f;
};

enum class StateKind : int32_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kGradAccum = 3 };

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
};

// What a checkpoint carries besides the tensors.
struct OptimizerCounters {
  uint64_t step = 0;
  uint64_t skipped_steps = 0;
  float loss_scale = 1.f;
  uint32_t growth_tracker = 0;
};

class Optimizer : public ExecutorHooks, public std::enable_shared_from_this<Optimizer> {
 public:
  static Status create(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config,
                       std::shared_ptr<Optimizer>* out);
  ~Optimizer() override;

  // Adds a trainable weight (DRAM, fp32/bf16/fp16) and its grad (DRAM, same element count,
  // fp32/bf16/fp16): allocates and initializes its state. Not once attached.
  Status add_param(TensorId weight, TensorId grad, uint32_t group);
  Status set_group(uint32_t group, const GroupHyperparams& h);
  Status state_tensor(TensorId weight, StateKind kind, TensorId* out);

  Status attach(Executor* executor);
  Status detach();
  // Updates every parameter now from its grad tensor (no executor attached). Attached in
  // explicit mode: queues the updates of every parameter holding a grad and returns.
  Status step();
  // Explicit mode, attached: the held grad of `weight`, read after any grads still landing.
  Status grad_info(TensorId weight, GradInfo* out);
  Status grad_read(TensorId weight, float* dst, uint64_t count);
  Status grad_scale(TensorId weight, float factor);
  Status grad_zero(TensorId weight, bool keep_zeros);
  // Explicit mode: a param's update count (restoring a framework's optimizer state).
  Status set_param_step(TensorId weight, uint64_t step);
  // Waits for every queued update; returns the first error of any.
  Status synchronize();
  OptimizerStats stats();

  const OptimizerConfig& config() const { return config_; }
  struct ParamView {
    TensorId weight, grad;
    TensorId master, exp_avg, exp_avg_sq;  // 0 where the kind has none; master may be weight
    uint64_t step;                         // explicit mode: updates this param received
  };
  std::vector<ParamView> params();
  // For checkpoints: between updates only (kInvalidState inside an accumulation or a step).
  Status quiesce_for_checkpoint(OptimizerCounters* counters);
  // A successful load: the counters, and a clean slate after an earlier failed load.
  // param_steps (explicit mode; empty: every param at counters.step) in params() order.
  Status restore_counters(const OptimizerCounters& counters,
                          const std::vector<uint64_t>& param_steps = {});
  // A failed load left the state inconsistent: every later step reports `why`.
  void invalidate(Status why);

  // ExecutorHooks
  Status on_step_begin() override;
  void on_step_end() override;
  void on_step_aborted() override;
  Status on_grads_queued(uint32_t layer, std::vector<std::shared_ptr<DeviceFence>> landed) override;
  bool layer_ready(uint32_t layer) override;
  Status wait_layer(uint32_t layer) override;
  void on_executor_destroyed() override;

 private:
  // Explicit mode: where a parameter's grad is (torch's p.grad: None, zeros, a tensor).
  enum class GradHold : uint8_t { kNone, kZero, kGrad, kAccum };
  struct Param {
    TensorId weight = 0, grad = 0, master = 0, exp_avg = 0, exp_avg_sq = 0, accum = 0;
    uint32_t group = 0;
    int layer = -1;
    std::size_t in_layer = 0;  // index among its layer's params
    optim::ParamArrays arrays;
    // Explicit mode. The grad's value is grad_mult times what `hold` names; grad_sq is the
    // sum of squares of the latter (set when the job that wrote it finishes).
    GradHold hold = GradHold::kNone;
    // The fp32 accumulator, allocated on first use (outside `arrays`, which pool threads copy
    // while other jobs run: only jobs queued after it was set read it).
    float* accum_data = nullptr;
    float grad_mult = 1.f;
    double grad_sq = 0;
    uint64_t t = 0;
  };
  // Explicit mode: one parameter's share of an update job (what step() saw when it queued it).
  struct UpdateSource {
    bool skip = true;            // no grad held
    const void* grad = nullptr;  // null with !skip: a zero grad
    DType dtype = DType::kF32;
    optim::AdamWScalars adamw;
    optim::SgdScalars sgd;
  };
  struct Task {
    std::size_t param;
    std::size_t begin, end;
  };
  // Per-step values every update of the step uses, latched when the step's first grads leave.
  struct StepScalars {
    uint64_t t = 0;
    float grad_scale = 1.f;
    bool skip = false;
    // Deferred steps: abandoned by strata_step_abort; the layers whose norms are in.
    bool aborted = false;
    std::vector<int> normed;
    std::vector<GroupHyperparams> groups;
    // Deferred steps: the layers' norms as they come in (the next step may already have begun).
    std::size_t norms_in = 0;
    double norm_squared = 0;
  };

  // kLand (explicit): a backward's grads arrived; kStash (explicit): a held grad moves to the
  // fp32 accumulator before the next backward overwrites the grad tensor.
  enum class JobKind { kAccumulate, kNorm, kUpdate, kLand, kStash };
  struct Job {
    JobKind kind;
    int layer;  // -1: every parameter
    std::vector<std::shared_ptr<DeviceFence>> landed;
    bool first_micro = false;              // kAccumulate: the accumulator starts from this grad
    std::size_t next_task = 0;             // of the layer's tasks: where a preempted job resumes
    std::shared_ptr<StepScalars> scalars;  // kNorm, kUpdate: the step they belong to
    // Explicit mode, per parameter of the layer: kLand adds to the accumulator (else takes the
    // grad as it landed), scaling the accumulator by mult first; kStash moves (if set);
    // sums collects each one's sum of squares across slices; kUpdate reads sources.
    std::vector<uint8_t> add;
    std::vector<float> mult;
    std::vector<double> sums;
    std::vector<UpdateSource> sources;
  };
  Optimizer(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config);
  Status make_state(const TensorRecord& weight, const char* suffix, uint64_t skew, TensorId* id,
                    float** data);
  std::vector<Task> tasks_for(const std::vector<std::size_t>& params) const;
  // Explicit-mode jobs (kLand, kStash, kUpdate with sources) over `tasks`.
  void run_explicit(std::span<const Task> tasks, Job& job);
  // The fp32 accumulator of a param, allocated on first use. Under mutex_.
  Status ensure_accum(Param& p);
  // Explicit mode: the param of `weight`, attached, its grads landed. Under mutex_ (waits).
  Status held_grad(TensorId weight, std::unique_lock<std::mutex>& lock, Param** out);
  Status step_explicit();  // under step_mutex_
  // Runs one kind of work over `tasks` on the pool; kNorm returns the sum of squares.
  double run_tasks(std::span<const Task> tasks, JobKind kind, const StepScalars* scalars,
                   bool first_micro);
  uint64_t job_bytes(std::span<const Task> tasks, JobKind kind) const;  // for the trace
  // After every norm is in: the step's grad scale and skip decision, and loss-scale update.
  void finish_norms(double total_squared, StepScalars* scalars);  // under mutex_
  void dispatcher_main();
  // The queued job to run next (queue_.size() if none has its grads yet). Under mutex_.
  std::size_t pick_job() const;
  // Until the latest deferred step has all its norms (its t and loss scale are then settled).
  void wait_for_norms(std::unique_lock<std::mutex>& lock);
  bool deferred() const { return config_.max_grad_norm > 0 || config_.dynamic_loss_scale; }
  void fail(Status s);  // under mutex_: the first failure sticks
  void unregister_state();

  std::shared_ptr<Runtime> runtime_;
  OptimizerConfig config_;
  const optim::KernelTable* kernels_;
  std::unique_ptr<optim::WorkerPool> pool_;
  std::vector<Param> params_;
  std::vector<TensorId> owned_, pinned_;
  uint64_t state_bytes_ = 0;

  std::mutex step_mutex_;  // serializes step(), which runs outside mutex_
  std::mutex mutex_;
  std::condition_variable cv_;  // jobs queued, a layer done, idle
  std::vector<GroupHyperparams> groups_;
  Executor* executor_ = nullptr;
  std::vector<std::vector<std::size_t>> layer_params_;  // per executor layer
  std::vector<std::vector<Task>> layer_tasks_;
  std::vector<int> pending_;  // per layer: queued jobs that write its weights
  std::vector<int> landing_;  // per layer: queued kLand / kStash jobs (explicit mode)
  bool in_executor_step_ = false;
  std::size_t layers_with_params_ = 0;
  std::deque<Job> queue_;
  std::size_t running_ = 0;
  bool stopping_ = false;
  Status failure_;
  // The step in flight (attached mode).
  std::shared_ptr<StepScalars> current_;
  std::size_t grads_in_ = 0;  // layers whose grads this step queued
  uint64_t micro_ = 0;        // executor steps into the accumulation
  bool final_micro_ = false;
  std::vector<Task> all_tasks_;  // every parameter (manual steps)
  std::size_t all_tasks_params_ = 0;
  // Counters.
  OptimizerCounters counters_;
  double last_norm_ = -1;
  double update_seconds_ = 0;
  std::thread dispatcher_;
};

}  // namespace strata
