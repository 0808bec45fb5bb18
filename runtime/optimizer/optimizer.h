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

#include <array>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "runtime/memory/checksums.h"
#include "runtime/optimizer/kernels.h"
#include "runtime/optimizer/optimizer_types.h"
#include "runtime/optimizer/worker_pool.h"
#include "runtime/runtime.h"
#include "runtime/stream/executor_hooks.h"

namespace strata {

class Executor;

class Optimizer : public ExecutorHooks, public std::enable_shared_from_this<Optimizer> {
 public:
  static Status create(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config,
                       std::shared_ptr<Optimizer>* out);
  ~Optimizer() override;

  // Adds a trainable weight (DRAM or NVMe, fp32/bf16/fp16) and its grad (DRAM or HBM, same
  // element count, fp32/bf16/fp16): allocates and initializes its state. Not once attached. An
  // NVMe-homed weight is staged through DRAM with the layer's NVMe-homed state for each
  // update (attached only) and written back before the executor loads the layer again. An
  // HBM-homed grad is copied into a DRAM buffer of the largest layer's grads by each job that
  // reads it (attached only).
  // kInPlace needs explicit mode and an fp32 grad in HBM (kInvalidArgument otherwise).
  Status add_param(TensorId weight, TensorId grad, uint32_t group,
                   MasterLayout layout = MasterLayout::kSeparate,
                   GradSum grad_sum = GradSum::kAccumulator);
  // lr and weight_decay of `group` (creating it as a copy of group 0); its betas and eps stay.
  Status set_group(uint32_t group, float lr, float weight_decay);
  // Every hyperparameter of `group` (creating it); checked as the config's are.
  Status set_group_hyperparams(uint32_t group, const GroupHyperparams& h);
  // `group`'s hyperparameters (group 0's for a group not created yet).
  Status group_hyperparams(uint32_t group, GroupHyperparams* out);
  Status state_tensor(TensorId weight, StateKind kind, TensorId* out);
  // A param's fp32 master (the weight when it is fp32), whatever its layout and tier; writing
  // sets the master and the working copy the executor streams (rounded as an update rounds).
  // Waits for queued updates; not inside an executor step (its updates and read-ahead run).
  Status master_read(TensorId weight, float* dst, uint64_t count);
  Status master_write(TensorId weight, const float* src, uint64_t count);

  Status attach(Executor* executor);
  Status detach();
  // Updates every parameter now from its grad tensor (no executor attached). Attached in
  // explicit mode: queues the updates of every parameter holding a grad and returns.
  Status step();
  // Explicit mode, attached: the held grad of `weight`, read after any grads still landing.
  Status grad_info(TensorId weight, GradInfo* out);
  Status grad_read(TensorId weight, float* dst, uint64_t count);
  Status grad_scale(TensorId weight, float factor);
  // Sets the held grad's values (fp32): stored in the grad tensor's dtype (DRAM or HBM) or in
  // the fp32 accumulator, wherever it is held (an in-place sum: exactly, in HBM); replaces any
  // pending factor.
  Status grad_write(TensorId weight, const float* src, uint64_t count);
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
  // Waits for the running job and the staging transfers. A failed optimizer refuses a save
  // and, for a load (`for_load`), drops the failed step's queued work so nothing runs after
  // the load writes its state (restore_counters then clears the failure).
  Status quiesce_for_checkpoint(OptimizerCounters* counters, bool for_load = false);
  // A successful load: the counters, and a clean slate after an earlier failed load.
  // param_steps (explicit mode; empty: every param at counters.step) in params() order.
  Status restore_counters(const OptimizerCounters& counters,
                          const std::vector<uint64_t>& param_steps = {});
  // A failed load left the state inconsistent: every later step reports `why`.
  void invalidate(Status why);

  // ExecutorHooks
  Status on_step_begin() override;
  Status on_backward_load(uint32_t layer, const std::vector<TensorId>& grads,
                          std::vector<HomeGrad>* modes) override;
  void on_backward_acquired(uint32_t layer) override;
  void on_step_end() override;
  void on_step_aborted(std::shared_ptr<DeviceFence> adds_done) override;
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
    // The fp32 accumulator, allocated at the first accumulation (outside `arrays`, which pool
    // threads copy while other jobs run: only jobs queued after it was set read it). In DRAM
    // (accum_data), or on NVMe (nvme_accum: accum_data null, the jobs that read or write it
    // find it in the layer's staging slot, staged[4]).
    float* accum_data = nullptr;
    bool nvme_accum = false;
    float grad_mult = 1.f;
    double grad_sq = 0;
    uint64_t t = 0;
    // State on NVMe (master unless the weight is fp32, exp_avg, exp_avg_sq: those it has),
    // and/or the weight itself on NVMe. Their arrays are null; while the layer's stage is in
    // DRAM, `staged` points at them in its slot, by StagedTensor::kind (set under mutex_
    // before an update can be picked).
    bool nvme_state = false;
    bool nvme_weight = false;
    bool split = false;  // MasterLayout::kSplit: `master` is the low halves (I16)
    std::array<void*, 5> staged{};
    // A grad homed in HBM (2 bytes per bf16 parameter of DRAM less): `arrays.grad` points at
    // its place in the DRAM fetch buffer (at fetch_offset, set at attach), which a job fills
    // from `grad_device` before its tasks read the grad (fetch_grads).
    bool hbm_grad = false;
    const unsigned char* grad_device = nullptr;
    uint64_t fetch_offset = 0;
    // GradSum::kInPlace (an fp32 hbm_grad; explicit mode): the grad tensor is the sum, held as
    // kGrad (never kAccum). A landing copies nothing, so grad_sq is measured lazily, when
    // `measured` is false (grad_info, grad_read), and kept until the sum changes.
    bool in_place = false;
    bool measured = true;
    // An in-place sum a write into failed (a factor's write-back, grad_write, grad_zero): its
    // values are unspecified, grad_sq NaN (measured), through later landings and aborts, until
    // a grad_zero or grad_write succeeds or a failed step is dropped; a factor on it is dropped.
    bool unknown = false;
    // A kMeasure job of its layer will measure it (queue_measurements); measure_error: the
    // last one failed (grad_info reports it; the next call queues another).
    bool measuring = false;
    Status measure_error;
  };
  // Explicit mode, per layer: where its backward pass is in the executor's step, which decides
  // what may touch its in-place sums: kLoaded from its backward load (the home zero-filled or
  // kept) to its acquire, kAcquired until its release (the framework's adds in flight).
  enum class Backward : uint8_t { kIdle, kLoaded, kAcquired };
  // NVMe-homed state (and weights) of one executor layer: laid out in one staging slot, read
  // in before the layer's update, written back after it.
  enum class StagePhase : uint8_t { kIdle, kReading, kStaged, kWriting };
  struct StagedTensor {
    TensorId id = 0;
    std::string name;
    uint64_t extent = 0, len = 0;  // on NVMe (len 4 KiB-rounded)
    std::shared_ptr<Checksums> crcs;
    uint64_t offset = 0;  // in the slot, 4 KiB-aligned
    std::size_t param = 0;
    int kind = 0;  // 0 master (or its low halves), 1 exp_avg, 2 exp_avg_sq, 3 the weight,
                   // 4 the grad accumulator
  };
  // What a job needs of its layer's slot, by class of staged tensor: the update's (state and
  // weights, kinds 0-3), the accumulators (kind 4). A slot holds the classes its jobs need:
  // an update reads the state (and the accumulators when it reads its grads from them), a
  // landing or a stash only the accumulators, and each writes back only what it changed.
  static constexpr uint8_t kStateClass = 1, kAccumClass = 2;
  static uint8_t stage_class(int kind) { return kind == 4 ? kAccumClass : kStateClass; }
  struct LayerStage {
    std::vector<StagedTensor> tensors;
    uint64_t bytes = 0;    // of a slot this layer uses
    uint8_t classes = 0;   // of its tensors (kStateClass, kAccumClass)
    uint8_t loaded = 0;    // classes whose tensors are in the slot (kStaged)
    uint8_t incoming = 0;  // classes being read (kReading)
    bool in_use = false;   // a job that needs the slot runs (its contents must not change)
    StagePhase phase = StagePhase::kIdle;
    int slot = -1;
    int outstanding = 0;  // transfers in flight
    Status status;        // the first failed transfer's
    // Read ahead of its update (no update was queued for it yet), in round `round`: a layer is
    // read ahead at most once per executor step, and dropped by synchronize().
    bool ahead = false;
    uint64_t round = 0;
    // Some of the layer's weights live on NVMe: the executor may load the layer again only
    // once the write-back has landed, so the update's pending_ count is held until then.
    bool holds_weights = false;
    bool pending_held = false;
  };
  struct StageIo {
    bool write;
    uint32_t layer;
    std::size_t tensor;
  };
  // Explicit mode: one parameter's share of an update job (what step() saw when it queued it).
  struct UpdateSource {
    bool skip = true;            // no grad held
    const void* grad = nullptr;  // null with !skip: a zero grad, unless staged_accum
    bool staged_accum = false;   // the grad is the NVMe-homed accumulator, in the layer's slot
    DType dtype = DType::kF32;
    optim::UpdateScalars scalars;  // of the optimizer's kind
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
  // fp32 accumulator before the next backward overwrites the grad tensor; kMeasure (explicit):
  // in-place sums measured (and one copied out for grad_read) through the fetch buffer.
  enum class JobKind { kAccumulate, kNorm, kUpdate, kLand, kStash, kMeasure };
  // grad_read of an in-place sum: the job copies the sum into `dst` (the caller's buffer, which
  // it waits on until `done`) and says how that went.
  struct SumRead {
    float* dst = nullptr;
    std::size_t slot = 0;  // the param's index in its layer
    float mult = 1.f;      // the param's grad_mult, applied to what is copied
    bool done = false;
    Status status;
  };
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
    std::shared_ptr<SumRead> read;  // kMeasure: a grad_read's copy out, if any
  };
  Optimizer(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config);
  // A DRAM byte buffer of the optimizer's own, "strata.optimizer.N.<suffix>" (staging,
  // the grads' fetch buffer): *id and *base, or *id 0 and the runtime's error. `role` picks its
  // part of the arena (Runtime::dram_parts_for): kGrad for the fetch buffer the GPU's copies
  // write (pinned), kOptimizerState for the staging slots only the CPU touches (unpinned).
  // drop_buffer gives it back (a no-op for 0) and zeroes *id.
  Status make_buffer(const char* suffix, uint64_t bytes, const char* pin_reason, Role role,
                     TensorId* id, unsigned char** base);
  void drop_buffer(TensorId* id);
  // Registers a state tensor in `home` (DRAM: *data points at it; NVMe: *data is null).
  // *zeroed (if given): its bytes are already all zero (Runtime::register_tensor).
  Status make_state(const TensorRecord& weight, const char* suffix, uint64_t skew, Tier home,
                    TensorId* id, void** data, DType dtype = DType::kF32, bool* zeroed = nullptr);
  // A failed optimizer: waits for the running job and the staging transfers, then drops the
  // queued jobs, the step's counts and explicit mode's held grads. Under mutex_.
  void drop_failed_step(std::unique_lock<std::mutex>& lock);
  // synchronize() under `lock` (held on return): no job running and no transfer in flight,
  // and, unless failed, every queued update and pending load done and copies read ahead
  // dropped; the optimizer's failure, if any.
  Status drain(std::unique_lock<std::mutex>& lock);
  // master_read/_write's frame: drained, between executor steps, `count` checked, all under
  // one hold of step_mutex_ and mutex_ (no step or update can start meanwhile).
  Status master_access(TensorId weight, uint64_t count, const char* what,
                       const std::function<Status(const Param&)>& access);
  // Where a new param's state of `bytes` goes under the placement policy.
  Tier state_home(uint64_t bytes);
  // Attach: lays out each layer's NVMe-homed state (and accumulators) and allocates the staging
  // slots: at most max_slots, in `room` bytes of DRAM (0: the largest free block, capped by
  // nvme_staging_bytes less the grad fetch buffer, as the PLANNED placement kept it).
  Status layout_stages(uint64_t room = 0, std::size_t max_slots = 0);
  void free_staging();
  // Under mutex_: gives free slots to layers whose update is queued, lowest layer first, and
  // returns the reads to start (outside mutex_: start_io).
  std::vector<StageIo> stage_more();
  // Under mutex_, at a step that updates: starts a round of reading ahead (descending: the
  // order updates follow the backward pass's grads).
  std::vector<StageIo> read_ahead(bool descending);
  void start_io(const std::vector<StageIo>& ios);
  void on_stage_io(const StageIo& io, Status s);
  // Under mutex_: after a job that used a layer's slot — the write-back of what it changed
  // (*wrote set), or the slot back at once (and the reads that slot lets start).
  // `dirty`: the classes the job changed; `update`: it was the layer's update.
  std::vector<StageIo> finish_stage(std::size_t layer, uint8_t dirty, bool update, bool* wrote);
  // The classes of `job`'s layer's slot that it needs (0: none, it runs without a slot).
  uint8_t stage_need(const Job& job) const;
  bool needs_stage(const Job& job) const { return stage_need(job) != 0; }
  // Under mutex_: a free slot, else one taken back from a layer read ahead that no queued
  // update needs yet; -1 if none.
  int take_slot(const std::vector<std::size_t>& queued_layers);
  int free_slot() const;  // under mutex_: a free slot, -1 if none
  void release_slot(std::size_t layer);
  bool stage_ready(const Job& job) const;
  // Grads homed in HBM: attach lays each layer's out in one DRAM buffer (the largest layer's
  // size), which the dispatcher's jobs, one at a time, fill before reading them.
  Status layout_grad_fetch();
  void free_grad_fetch();
  // Whether `job` reads the grad tensor of `p` (not its accumulator, a zero, or nothing).
  static bool reads_grad(const Job& job, const Param& p);
  // Starts copying the HBM-homed grads of `tasks` that `job` reads into the fetch buffer, all
  // at once (in task order, on the D2H queue): (*arrivals)[k] is task k's fence, null where
  // it reads nothing from HBM. The tasks wait for their own (Arrivals::wait), so the first
  // computes while the rest still arrive. Dispatcher thread only (the buffer is the running
  // job's): every fence is waited for before another job runs (Arrivals::drain).
  struct Arrivals {
    std::vector<std::shared_ptr<DeviceFence>> fences;
    std::mutex mutex;
    Status failed;             // the first failed wait
    bool wait(std::size_t k);  // false: the copy failed (the task must not run)
    Status drain();
  };
  Status fetch_grads(std::span<const Task> tasks, const Job& job, Arrivals* arrivals);
  // A fetch of `layer`'s grads that failed with `s`, as the job reports it.
  static Status fetch_failed(int layer, const Status& s);
  // The arrays an update of `p` uses: staged state for NVMe-homed params.
  optim::ParamArrays update_arrays(const Param& p) const;
  std::vector<Task> tasks_for(const std::vector<std::size_t>& params) const;
  // Runs part(begin, end) over [0, n) in pieces on the pool: new state written by every
  // thread (one thread writes an 8B model's 96 GB of master, m and v in ~10 s). Under
  // step_mutex_ (the pool runs one job at a time).
  void init_on_pool(std::size_t n, const std::function<void(std::size_t, std::size_t)>& part);
  // Explicit-mode jobs (kLand, kStash, kUpdate with sources) over `tasks`.
  void run_explicit(std::span<const Task> tasks, Job& job, Arrivals* arrivals = nullptr,
                    std::size_t offset = 0);
  // The fp32 accumulator of a param: at the first accumulation every param's is allocated at
  // once (plan_accumulators). Under mutex_ (`lock`; it may wait for queued work).
  Status ensure_accum(Param& p, std::unique_lock<std::mutex>& lock);
  // Places every param's accumulator: in DRAM when its free space holds them all, else, with an
  // NVMe tier, the last layers' on NVMe, staged through the slots (laid out again, bigger), the
  // first layers' in what DRAM has left beside the slots; an error that names the numbers and
  // the remedies when no tier has room. Under mutex_ (`lock`: waits for queued work when the
  // slots are laid out again).
  Status plan_accumulators(std::unique_lock<std::mutex>& lock);
  // Gives every accumulator back (a failed plan_accumulators).
  void drop_accumulators(std::size_t owned_before, std::size_t pinned_before);
  // Where a job reads and writes `p`'s accumulator: DRAM, or its layer's slot.
  float* accum_ptr(const Param& p) const {
    return p.nvme_accum ? static_cast<float*>(p.staged[4]) : p.accum_data;
  }
  // Explicit mode: the param of `weight`, attached, its grads landed. Under mutex_ (waits).
  // `what` (a call's name): an in-place sum whose layer is acquired for its backward pass
  // (its adds in flight) is refused with kInvalidState.
  Status held_grad(TensorId weight, std::unique_lock<std::mutex>& lock, Param** out,
                   const char* what);
  // Until the adds of an abort with `layer` acquired are done (aborted_adds_), waited for
  // without the lock. Under mutex_.
  Status wait_aborted_adds(std::size_t layer, std::unique_lock<std::mutex>& lock);
  // kInvalidState naming `what` if `p` is an in-place sum whose layer is acquired for its
  // backward pass (the framework's adds in flight). Under mutex_.
  Status sum_at_rest(const Param& p, const char* what);
  // In-place sums (optimizer_sums.cpp), under mutex_. The sum's fp32 values, copied out of HBM.
  Status fetch_sum(const Param& p, std::vector<float>* values) const;
  // grad_sq from the sum's `values`, per task of its layer as a landing measures a grad (so
  // the figure is bit for bit the accumulator's); `measured` set.
  void measure_sum(Param& p, const float* values);
  // Queues a kMeasure job for every layer not acquired for its backward pass that has an
  // in-place sum held, unmeasured and not being measured, and (`read`: for grad_read) one for
  // read->slot's layer that copies that sum out. Counted in landing_, which held_grad, the
  // backward load and the backward acquire wait for: nothing writes or adds to a sum while it
  // is read.
  void queue_measurements(const Param* reader, std::shared_ptr<SumRead> read);
  // Measures the sum if it is not, as a kMeasure job (with every other unmeasured sum's), and
  // waits for its layer's.
  Status ensure_measured(Param& p, std::unique_lock<std::mutex>& lock);
  // Copies an in-place sum into dst (the param's count), times its grad_mult, measuring it on
  // the way, as a kMeasure job; waits for it.
  Status read_sum(Param& p, float* dst, std::unique_lock<std::mutex>& lock);
  // A kMeasure job done (`status`: how its fetch went): its figures, its read. Under mutex_.
  void finish_measure(const Job& job, const Status& status);
  // Writes `src` (fp32, the param's count; null: zeros) into the sum through the H2D queue,
  // the one the executor's zero fills go through, and waits for it: a fill queued before it
  // cannot land after it. On failure the values are unspecified.
  Status write_sum(const Param& p, const float* src);
  // A write into p's sum failed: its values unspecified from now on (Param::unknown).
  void mark_unknown(Param& p);
  // A held sum's pending grad_mult applied in HBM (copied out, scaled, written back): at its
  // layer's backward load, before the framework adds to it.
  Status apply_sum_factor(Param& p);
  Status step_explicit();  // under step_mutex_
  // Runs one kind of work over `tasks` on the pool; kNorm returns the sum of squares.
  // `arrivals` (may be null): task k waits for arrivals->wait(offset + k) first.
  double run_tasks(std::span<const Task> tasks, JobKind kind, const StepScalars* scalars,
                   bool first_micro, Arrivals* arrivals = nullptr, std::size_t offset = 0);
  uint64_t job_bytes(std::span<const Task> tasks, JobKind kind) const;  // for the trace
  // After every norm is in: the step's grad scale and skip decision, and loss-scale update.
  void finish_norms(double total_squared, StepScalars* scalars);  // under mutex_
  void dispatcher_main();
  // The queued job to run next (queue_.size() if none has its grads yet). Under mutex_.
  std::size_t pick_job() const;
  // Under mutex_: whether some queued update waits for a staging slot (its state is on NVMe
  // and not being read).
  bool slot_starved() const;
  // Under mutex_: whether `a` runs before `b` (pick_job's order, and preemption's).
  bool runs_before(const Job& a, const Job& b, bool starved) const;
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
  // NVMe-homed state and its staging (attached).
  uint64_t nvme_state_bytes_ = 0;
  uint64_t nvme_state_params_ = 0;
  uint64_t nvme_weight_params_ = 0;  // params whose weight is NVMe-homed
  std::vector<LayerStage> stages_;   // per executor layer
  std::size_t nvme_layers_ = 0;
  // Executor steps that will be followed by updates read NVMe-homed state ahead (the order:
  // descending when updates follow grads, ascending when they run in forward order).
  uint64_t ahead_round_ = 0;  // 0: nothing to read ahead
  uint64_t rounds_ = 0;
  bool ahead_descending_ = false;
  TensorId staging_id_ = 0;
  unsigned char* staging_base_ = nullptr;
  uint64_t slot_bytes_ = 0;
  std::vector<uint8_t> slot_free_;
  uint64_t staging_bytes_ = 0;
  int io_in_flight_ = 0;  // staging transfers whose callback has not run
  uint64_t nvme_read_bytes_ = 0, nvme_write_bytes_ = 0;
  double stage_wait_seconds_ = 0;
  // Accumulators (explicit mode): placed at the first accumulation, kept from then on.
  bool accum_planned_ = false;
  uint64_t accum_dram_bytes_ = 0, accum_nvme_bytes_ = 0;
  // Grads homed in HBM, and the DRAM buffer they are fetched into (attached).
  std::size_t hbm_grad_params_ = 0;
  TensorId grad_fetch_id_ = 0;
  unsigned char* grad_fetch_base_ = nullptr;
  uint64_t grad_fetch_bytes_ = 0;

  // Serializes step(), which runs the pool outside mutex_, and add_param, which runs it to
  // initialize state.
  std::mutex step_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_;  // jobs queued, a layer done, idle
  std::vector<GroupHyperparams> groups_;
  Executor* executor_ = nullptr;
  std::vector<std::vector<std::size_t>> layer_params_;  // per executor layer
  std::vector<std::vector<Task>> layer_tasks_;
  std::vector<int> pending_;  // per layer: queued jobs that write its weights
  std::vector<int> landing_;  // per layer: queued kLand / kStash / kMeasure jobs (explicit mode)
  std::vector<Backward> backward_;  // per layer (explicit mode)
  // Per layer (explicit mode): an abort with it acquired for its backward pass, the fence of
  // the framework's work on it (on_step_aborted), until someone waited for it. Its in-place
  // sums are read or written only after it: held_grad waits for it, a measurement job has it
  // as its `landed`, the backward load waits for it.
  std::vector<std::shared_ptr<DeviceFence>> aborted_adds_;
  std::size_t in_place_params_ = 0;
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
