// The parameter and state registry: which weights the optimizer updates, the fp32 state it
// allocates for them (DRAM or NVMe), param groups, and the tasks an update is cut into.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "runtime/memory/tensor_registry.h"
#include "runtime/optimizer/layout_sizes.h"
#include "runtime/optimizer/optimizer_internal.h"

namespace strata {

namespace {
// Elements per task: large enough that claiming a task costs nothing next to it, small enough
// that a layer splits over every thread. A multiple of 64 keeps tasks on cache-line bounds.
constexpr std::size_t kMinTaskElements = 1 << 16;

constexpr std::size_t kMaxTaskElements = 1 << 20;

// Elements per piece when new state is initialized on the pool.
constexpr std::size_t kInitPieceElements = 1 << 22;

uint64_t element_count(const TensorRecord& r) {
  return r.nbytes / dtype_size(r.spec.dtype);
}

// A state tensor's name: the weight's plus a suffix. When that would pass the registry's
// limit, a prefix of the weight's name (cut at a UTF-8 character boundary) and a hash of all
// of it stand in, so every weight a runtime accepts can be made trainable, under the same name
// in every run (checkpoints find state by name).
std::string state_name(const std::string& weight, const char* suffix) {
  std::string name = weight + suffix;
  if (name.size() <= TensorRegistry::kMaxNameLength) return name;
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64
  for (unsigned char c : weight) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char tag[20];
  std::snprintf(tag, sizeof tag, "~%016llx", static_cast<unsigned long long>(h));
  std::size_t keep = TensorRegistry::kMaxNameLength - std::strlen(suffix) - std::strlen(tag);
  while (keep > 0 && (static_cast<unsigned char>(weight[keep]) & 0xC0) == 0x80) --keep;
  return weight.substr(0, keep) + tag + suffix;
}

constexpr uint32_t kMaxOptimizerGroups = 1u << 16;

// Groups are a dense table indexed by number: a bound keeps `group + 1` from wrapping and a
// hostile number from allocating gigabytes.
Status check_group(uint32_t group) {
  if (group >= kMaxOptimizerGroups) {
    return error(Code::kInvalidArgument, "group ", group, " is out of range (groups are 0..",
                 kMaxOptimizerGroups - 1, ")");
  }
  return Status::ok();
}
}  // namespace

void Optimizer::unregister_state() {
  for (TensorId id : pinned_) runtime_->unpin(id);
  pinned_.clear();
  for (TensorId id : owned_) (void)runtime_->unregister(id);
  owned_.clear();
}

Status Optimizer::make_buffer(const char* suffix, uint64_t bytes, const char* pin_reason, Role role,
                              TensorId* id, unsigned char** base) {
  static std::atomic<uint64_t> serial{0};
  TensorSpec spec;
  spec.name = "strata.optimizer." + std::to_string(serial.fetch_add(1)) + "." + suffix;
  spec.dtype = DType::kU8;
  spec.shape = {static_cast<int64_t>(bytes)};
  spec.role = role;
  spec.home = Tier::kDram;
  Status s = runtime_->register_tensor(spec, id);
  if (!s.is_ok()) {
    *id = 0;
    return s;
  }
  TensorRecord r;
  (void)runtime_->info(*id, &r);
  (void)runtime_->pin_in_place(*id, pin_reason);
  *base = runtime_->tier_base(Tier::kDram) + r.offset;
  return Status::ok();
}

void Optimizer::drop_buffer(TensorId* id) {
  if (*id != 0) {
    runtime_->unpin(*id);
    (void)runtime_->unregister(*id);
  }
  *id = 0;
}

Status Optimizer::make_state(const TensorRecord& weight, const char* suffix, uint64_t skew,
                             Tier home, TensorId* id, void** data, DType dtype, bool* zeroed) {
  TensorSpec spec;
  spec.name = state_name(weight.spec.name, suffix);
  spec.dtype = dtype;
  spec.shape = weight.spec.shape;
  spec.role = Role::kOptimizerState;
  spec.home = home;
  Status s = runtime_->register_tensor(spec, id, home == Tier::kDram ? skew : 0, zeroed);
  if (!s.is_ok()) {
    return error(s.code(), "optimizer state for '", weight.spec.name, "': ", s.message());
  }
  owned_.push_back(*id);
  STRATA_RETURN_IF_ERROR(runtime_->pin_in_place(*id, "optimizer"));
  pinned_.push_back(*id);
  TensorRecord r;
  STRATA_RETURN_IF_ERROR(runtime_->info(*id, &r));
  if (home == Tier::kDram) {
    *data = runtime_->tier_base(Tier::kDram) + r.offset;
    state_bytes_ += r.nbytes;
  } else {
    *data = nullptr;
    nvme_state_bytes_ += r.nbytes;
  }
  return Status::ok();
}

Tier Optimizer::state_home(uint64_t bytes) {
  switch (config_.state_placement) {
    case StatePlacement::kInDram:
      return Tier::kDram;
    case StatePlacement::kOnNvme:
      return Tier::kNvme;
    case StatePlacement::kPlanned:
      break;
  }
  if (!runtime_->tier_available(Tier::kNvme)) return Tier::kDram;
  const TierUsage dram = runtime_->tier_usage(Tier::kDram);
  const uint64_t keep =
      config_.nvme_staging_bytes != 0 ? config_.nvme_staging_bytes : dram.budget / 8;
  // What a layout counts the state as (strata_layout_query): a little more than `bytes`.
  const uint64_t need = planned_state_bytes(bytes);
  const uint64_t free = dram.budget - dram.used;
  return dram.largest_free >= need && free >= need && free - need >= keep ? Tier::kDram
                                                                          : Tier::kNvme;
}

void Optimizer::init_on_pool(std::size_t n,
                             const std::function<void(std::size_t, std::size_t)>& part) {
  const std::size_t pieces = (n + kInitPieceElements - 1) / kInitPieceElements;
  pool_->run(pieces, [&](std::size_t k) {
    part(k * kInitPieceElements, std::min(n, (k + 1) * kInitPieceElements));
  });
}

Status Optimizer::add_param(TensorId weight, TensorId grad, uint32_t group, MasterLayout layout,
                            GradSum grad_sum) {
  STRATA_RETURN_IF_ERROR(check_group(group));
  if (layout != MasterLayout::kSeparate && layout != MasterLayout::kSplit) {
    return error(Code::kInvalidArgument, "unknown master_layout ", static_cast<uint32_t>(layout),
                 " (STRATA_MASTER_SEPARATE 0, STRATA_MASTER_SPLIT 1)");
  }
  if (grad_sum != GradSum::kAccumulator && grad_sum != GradSum::kInPlace) {
    return error(Code::kInvalidArgument, "unknown grad_sum ", static_cast<uint32_t>(grad_sum),
                 " (STRATA_GRAD_SUM_ACCUMULATOR 0, STRATA_GRAD_SUM_IN_PLACE 1)");
  }
  const bool in_place = grad_sum == GradSum::kInPlace;
  if (in_place && !config_.explicit_updates) {
    // AUTO mode sums micro-steps in its own accumulators (accumulation_steps), on the CPU.
    return error(Code::kInvalidArgument,
                 "grad_sum STRATA_GRAD_SUM_IN_PLACE needs update_mode STRATA_UPDATE_EXPLICIT, "
                 "where the framework adds each backward pass's grad into the sum; this "
                 "optimizer's AUTO mode sums accumulation_steps in its fp32 accumulators");
  }
  // The new state is initialized on the pool, which runs one job at a time: a manual step()
  // (the only other user while unattached) holds step_mutex_ while it runs.
  std::lock_guard serial(step_mutex_);
  std::lock_guard lock(mutex_);
  if (executor_ != nullptr) {
    return error(Code::kInvalidState, "add_param after the optimizer was attached to an executor");
  }
  TensorRecord w, g;
  STRATA_RETURN_IF_ERROR(runtime_->info(weight, &w));
  STRATA_RETURN_IF_ERROR(runtime_->info(grad, &g));
  if (weight == grad) {
    return error(Code::kInvalidArgument, "tensor '", w.spec.name, "' given as its own grad");
  }
  for (const Param& p : params_) {
    for (TensorId used : {p.weight, p.grad}) {
      if (used == weight || used == grad) {
        TensorRecord r;
        (void)runtime_->info(used, &r);
        return error(Code::kAlreadyExists, "tensor '", r.spec.name,
                     "' already belongs to a parameter of this optimizer");
      }
    }
  }
  if (w.tier != Tier::kDram && w.tier != Tier::kNvme) {
    return error(Code::kUnsupported, "weight '", w.spec.name, "' is in ", tier_name(w.tier),
                 ": the optimizer updates weights in DRAM, or on NVMe staged through DRAM");
  }
  if (g.tier != Tier::kDram && g.tier != Tier::kHbm) {
    return error(Code::kUnsupported, "grad '", g.spec.name, "' is in ", tier_name(g.tier),
                 ": the optimizer reads grads in DRAM, or in HBM fetched into DRAM");
  }
  for (const TensorRecord* r : {&w, &g}) {
    const char* role = r == &w ? "weight" : "grad";
    if (!optim::float_dtype(r->spec.dtype)) {
      return error(Code::kInvalidArgument, role, " '", r->spec.name, "' is ",
                   dtype_name(r->spec.dtype), ": the optimizer takes f32, bf16 or f16");
    }
  }
  if (layout == MasterLayout::kSplit && w.spec.dtype == DType::kF16) {
    return error(Code::kInvalidArgument, "weight '", w.spec.name,
                 "' is f16: a split master needs a bf16 weight (the upper half of an fp32), "
                 "use STRATA_MASTER_SEPARATE");
  }
  if (element_count(w) != element_count(g)) {
    return error(Code::kInvalidArgument, "grad '", g.spec.name, "' has ", element_count(g),
                 " elements, weight '", w.spec.name, "' has ", element_count(w));
  }
  if (in_place && (g.tier != Tier::kHbm || g.spec.dtype != DType::kF32)) {
    return error(Code::kInvalidArgument, "grad '", g.spec.name, "' is ", dtype_name(g.spec.dtype),
                 " in ", tier_name(g.tier),
                 ": an in-place gradient sum (STRATA_GRAD_SUM_IN_PLACE) is the grad tensor "
                 "itself, which must be F32 (the sum of several backward passes) in HBM (where "
                 "the framework adds to it)");
  }
  const std::size_t owned_before = owned_.size(), pinned_before = pinned_.size();
  const uint64_t bytes_before = state_bytes_;
  auto roll_back = [&](Status s) {
    while (pinned_.size() > pinned_before) {
      runtime_->unpin(pinned_.back());
      pinned_.pop_back();
    }
    while (owned_.size() > owned_before) {
      (void)runtime_->unregister(owned_.back());
      owned_.pop_back();
    }
    state_bytes_ = bytes_before;
    return s;
  };
  Param p;
  p.weight = weight;
  p.grad = grad;
  p.group = group;
  for (TensorId id : {weight, grad}) {
    Status s = runtime_->pin_in_place(id, "optimizer");
    if (!s.is_ok()) return roll_back(s);
    pinned_.push_back(id);
  }
  unsigned char* dram = runtime_->tier_base(Tier::kDram);
  const std::size_t n = element_count(w);
  optim::ParamArrays& a = p.arrays;
  a.count = n;
  // An HBM-homed grad is read through the fetch buffer attach lays out (arrays.grad set there).
  p.hbm_grad = g.tier == Tier::kHbm;
  p.in_place = in_place;
  if (p.hbm_grad) {
    p.grad_device = runtime_->tier_base(Tier::kHbm) + g.offset;
  } else {
    a.grad = dram + g.offset;
  }
  a.grad_dtype = g.spec.dtype;
  // An NVMe-homed weight: its values (the master's initial ones) come through a bounce buffer;
  // updates reach it through the layer's staging slot.
  p.nvme_weight = w.tier == Tier::kNvme;
  std::vector<unsigned char> weight_values;
  const void* weight_data = p.nvme_weight ? nullptr : dram + w.offset;
  if (p.nvme_weight) {
    weight_values.resize(w.nbytes);
    Status s = runtime_->read(weight, 0, weight_values.data(), w.nbytes);
    if (!s.is_ok()) return roll_back(s);
    weight_data = weight_values.data();
  }
  const StateSet kept = state_set(config_.kind, config_.momentum);
  const bool has_master = w.spec.dtype != DType::kF32;
  // A split master keeps only the low halves: the bf16 weight is the rest (kernels_impl.h).
  p.split = has_master && layout == MasterLayout::kSplit;
  const uint64_t state_bytes =
      n * state_bytes_per_element(kept.exp_avg != nullptr, kept.exp_avg_sq != nullptr, w.spec.dtype,
                                  p.split);
  const Tier home = state_bytes == 0 ? Tier::kDram : state_home(state_bytes);
  p.nvme_state = home == Tier::kNvme;
  const uint64_t nvme_before = nvme_state_bytes_;
  auto roll_back_all = [&](Status s) {
    nvme_state_bytes_ = nvme_before;
    return roll_back(std::move(s));
  };
  // A new state tensor of `dtype`, zeroed: on NVMe through a bounce buffer of zeros, in DRAM
  // on the pool, unless its block is DRAM no tensor held before, zero since the arena was
  // mapped (at set-up, nearly all of the moments' and split masters' blocks: writing them again
  // was a second pass over 10 bytes per parameter, 80 GB for an 8B).
  auto zeroed = [&](const char* suffix, uint64_t skew, DType dtype, TensorId* id,
                    void** data) -> Status {
    bool already = false;
    STRATA_RETURN_IF_ERROR(make_state(w, suffix, skew, home, id, data, dtype, &already));
    if (already) return Status::ok();
    const std::size_t elem = dtype_size(dtype);
    if (home == Tier::kNvme) {
      const std::vector<unsigned char> zeros(n * elem);
      return runtime_->write(*id, 0, zeros.data(), zeros.size());
    }
    auto* bytes = static_cast<unsigned char*>(*data);
    init_on_pool(
        n, [&](std::size_t b, std::size_t e) { std::memset(bytes + b * elem, 0, (e - b) * elem); });
    return Status::ok();
  };
  if (!has_master) {
    // The fp32 weight is its own master: no second copy to keep in step.
    p.master = weight;
    a.master = p.nvme_weight ? nullptr : reinterpret_cast<float*>(dram + w.offset);
  } else {
    a.weight = p.nvme_weight ? nullptr : dram + w.offset;
    a.weight_dtype = w.spec.dtype;
  }
  if (p.split) {
    // The master starts as the weight, exactly: its low halves are zero.
    void* low = nullptr;
    Status s = zeroed(".master_low", kSkew[0], DType::kI16, &p.master, &low);
    a.master_low = static_cast<int16_t*>(low);
    if (!s.is_ok()) return roll_back_all(s);
  } else if (has_master) {
    void* master = nullptr;
    Status s = make_state(w, ".master", kSkew[0], home, &p.master, &master);
    if (!s.is_ok()) return roll_back_all(s);
    a.master = static_cast<float*>(master);
    // The master starts as the working copy, exactly (bf16 and f16 widen without rounding):
    // in place in DRAM, through a bounce buffer to NVMe.
    std::vector<float> bounce(home == Tier::kNvme ? n : 0);
    float* to = home == Tier::kNvme ? bounce.data() : a.master;
    const optim::ParamArrays widen{to,      nullptr,     nullptr, weight_data, w.spec.dtype, to,
                                   nullptr, DType::kF32, n};
    init_on_pool(n, [&](std::size_t b, std::size_t e) { kernels_->accumulate(widen, b, e, true); });
    if (home == Tier::kNvme) s = runtime_->write(p.master, 0, bounce.data(), n * sizeof(float));
    if (!s.is_ok()) return roll_back_all(s);
  }
  if (kept.exp_avg != nullptr) {
    void* data = nullptr;
    Status s = zeroed(kept.exp_avg, kSkew[1], DType::kF32, &p.exp_avg, &data);
    a.exp_avg = static_cast<float*>(data);
    if (!s.is_ok()) return roll_back_all(s);
  }
  if (kept.exp_avg_sq != nullptr) {
    void* data = nullptr;
    Status s = zeroed(kept.exp_avg_sq, kSkew[2], DType::kF32, &p.exp_avg_sq, &data);
    a.exp_avg_sq = static_cast<float*>(data);
    if (!s.is_ok()) return roll_back_all(s);
  }
  if (config_.accumulation_steps > 1) {
    void* data = nullptr;
    Status s = make_state(w, ".grad_accum", kSkew[3], Tier::kDram, &p.accum, &data);
    a.grad_accum = static_cast<float*>(data);
    if (!s.is_ok()) return roll_back_all(s);
  }
  if (p.nvme_state) ++nvme_state_params_;
  if (p.nvme_weight) ++nvme_weight_params_;
  if (p.hbm_grad) ++hbm_grad_params_;
  if (p.in_place) ++in_place_params_;
  if (group >= groups_.size()) groups_.resize(group + 1, groups_.front());
  params_.push_back(std::move(p));
  return Status::ok();
}

Status Optimizer::set_group(uint32_t group, float lr, float weight_decay) {
  STRATA_RETURN_IF_ERROR(check_group(group));
  STRATA_RETURN_IF_ERROR(check_finite("lr", lr, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("weight_decay", weight_decay, 0.f, true));
  std::lock_guard lock(mutex_);
  if (group >= groups_.size()) groups_.resize(group + 1, groups_.front());
  groups_[group].lr = lr;
  groups_[group].weight_decay = weight_decay;
  return Status::ok();
}

Status Optimizer::set_group_hyperparams(uint32_t group, const GroupHyperparams& h) {
  STRATA_RETURN_IF_ERROR(check_group(group));
  STRATA_RETURN_IF_ERROR(check_finite("lr", h.lr, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("weight_decay", h.weight_decay, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_betas(h.beta1, h.beta2, h.eps));
  std::lock_guard lock(mutex_);
  if (group >= groups_.size()) groups_.resize(group + 1, groups_.front());
  groups_[group] = h;
  return Status::ok();
}

Status Optimizer::group_hyperparams(uint32_t group, GroupHyperparams* out) {
  STRATA_RETURN_IF_ERROR(check_group(group));
  std::lock_guard lock(mutex_);
  *out = groups_[group < groups_.size() ? group : 0];
  return Status::ok();
}

Status Optimizer::state_tensor(TensorId weight, StateKind kind, TensorId* out) {
  std::lock_guard lock(mutex_);
  for (const Param& p : params_) {
    if (p.weight != weight) continue;
    if (p.split && kind == StateKind::kMaster) {
      return error(Code::kNotFound,
                   "the weight's master is split (STRATA_MASTER_SPLIT): its upper half is the "
                   "bf16 weight, its lower half the STRATA_STATE_MASTER_LOW tensor; "
                   "strata_optimizer_master_read/_write give and take it as fp32");
    }
    const TensorId id = kind == StateKind::kMaster      ? p.master
                        : kind == StateKind::kMasterLow ? (p.split ? p.master : 0)
                        : kind == StateKind::kExpAvg    ? p.exp_avg
                        : kind == StateKind::kExpAvgSq  ? p.exp_avg_sq
                                                        : p.accum;
    if (id == 0) {
      return error(Code::kNotFound, "this optimizer keeps no such state (kind ",
                   static_cast<int>(kind), ") for the weight");
    }
    *out = id;
    return Status::ok();
  }
  return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
}

Status Optimizer::master_access(TensorId weight, uint64_t count, const char* what,
                                const std::function<Status(const Param&)>& access) {
  // step_mutex_: no manual step() runs its kernels meanwhile. Drained under mutex_ and held
  // through the access: no update, read-ahead or executor step starts until it is done (the
  // whole-tensor reads and writes hold it: this is a between-steps call).
  std::lock_guard serial(step_mutex_);
  std::unique_lock lock(mutex_);
  STRATA_RETURN_IF_ERROR(drain(lock));
  if (in_executor_step_) {
    return error(Code::kInvalidState, what,
                 " inside an executor step (its updates and state read-ahead run): call it "
                 "between steps");
  }
  for (const Param& p : params_) {
    if (p.weight != weight) continue;
    if (count != p.arrays.count) {
      return error(Code::kInvalidArgument, what, ": count is ", count, ", the param has ",
                   p.arrays.count, " elements");
    }
    return access(p);
  }
  return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
}

Status Optimizer::master_read(TensorId weight, float* dst, uint64_t count) {
  return master_access(weight, count, "master_read", [&](const Param& p) {
    const std::size_t n = p.arrays.count;
    if (p.master == p.weight || !p.split) {  // fp32: the weight or the master itself
      return runtime_->read(p.master, 0, dst, n * sizeof(float));
    }
    std::vector<uint16_t> hi(n);
    std::vector<int16_t> low(n);
    STRATA_RETURN_IF_ERROR(runtime_->read(p.weight, 0, hi.data(), n * sizeof(uint16_t)));
    STRATA_RETURN_IF_ERROR(runtime_->read(p.master, 0, low.data(), n * sizeof(int16_t)));
    optim::ParamArrays v;
    v.weight = hi.data();
    v.weight_dtype = DType::kBF16;
    v.master_low = low.data();
    v.count = n;
    kernels_->master_get(v, dst, 0, n);
    return Status::ok();
  });
}

Status Optimizer::master_write(TensorId weight, const float* src, uint64_t count) {
  return master_access(weight, count, "master_write", [&](const Param& p) {
    const std::size_t n = p.arrays.count;
    if (p.master == p.weight) return runtime_->write(p.weight, 0, src, n * sizeof(float));
    // The working copy and the master (or its low halves), as an update writes them.
    std::vector<unsigned char> copy(n * dtype_size(p.arrays.weight_dtype));
    std::vector<float> master(p.split ? 0 : n);
    std::vector<int16_t> low(p.split ? n : 0);
    optim::ParamArrays v;
    v.weight = copy.data();
    v.weight_dtype = p.arrays.weight_dtype;
    v.master = p.split ? nullptr : master.data();
    v.master_low = p.split ? low.data() : nullptr;
    v.count = n;
    kernels_->master_set(v, src, 0, n);
    STRATA_RETURN_IF_ERROR(p.split
                               ? runtime_->write(p.master, 0, low.data(), n * sizeof(int16_t))
                               : runtime_->write(p.master, 0, master.data(), n * sizeof(float)));
    Status s = runtime_->write(p.weight, 0, copy.data(), copy.size());
    // The master is written and its weight is not: they no longer belong together.
    if (!s.is_ok()) failure_ = s;
    return s;
  });
}

std::vector<Optimizer::ParamView> Optimizer::params() {
  std::lock_guard lock(mutex_);
  std::vector<ParamView> out;
  for (const Param& p : params_) {
    out.push_back(ParamView{p.weight, p.grad, p.master, p.exp_avg, p.exp_avg_sq, p.t});
  }
  return out;
}

std::vector<Optimizer::Task> Optimizer::tasks_for(const std::vector<std::size_t>& params) const {
  uint64_t total = 0;
  for (std::size_t i : params) total += params_[i].arrays.count;
  const uint64_t per_thread = total / (4ull * pool_->size()) + 1;
  const std::size_t chunk =
      (std::clamp<uint64_t>(per_thread, kMinTaskElements, kMaxTaskElements) + 63) / 64 * 64;
  std::vector<Task> tasks;
  for (std::size_t i : params) {
    const std::size_t n = params_[i].arrays.count;
    for (std::size_t b = 0; b < n; b += chunk) tasks.push_back(Task{i, b, std::min(n, b + chunk)});
    if (n == 0) tasks.push_back(Task{i, 0, 0});
  }
  return tasks;
}

}  // namespace strata
