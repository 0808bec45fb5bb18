#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "common/clock.h"
#include "common/spawn.h"
#include "runtime/executor.h"
#include "runtime/nvme_tier.h"
#include "runtime/tensor_registry.h"

namespace strata {
namespace {

// Elements per task: large enough that claiming a task costs nothing next to it, small enough
// that a layer splits over every thread. A multiple of 64 keeps tasks on cache-line bounds.
constexpr std::size_t kMinTaskElements = 1 << 16;
constexpr std::size_t kMaxTaskElements = 1 << 20;
// Where each state array starts within a 4 KiB page (master, exp_avg, exp_avg_sq, grad_accum;
// the weight and grad, registered by the framework, start at 0). The update streams all of
// them at once: at equal page offsets they collide in the caches (4K aliasing).
constexpr uint64_t kSkew[4] = {1088, 2176, 3264, 576};

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

// Staging slots: at most this many layers' NVMe-homed state in DRAM at once. Past a few, more
// read-ahead does not help: the disk is the bottleneck, and DRAM is better spent on state.
constexpr std::size_t kMaxStagingSlots = 4;

Status check_finite(const char* what, float v, float lo, bool lo_inclusive) {
  if (!std::isfinite(v) || v < lo || (!lo_inclusive && v == lo)) {
    return error(Code::kInvalidArgument, "optimizer config: ", what, " is ", v, ", must be ",
                 lo_inclusive ? ">= " : "> ", lo);
  }
  return Status::ok();
}

Status validate(const OptimizerConfig& c) {
  if (c.kind != OptimizerKind::kAdamW && c.kind != OptimizerKind::kSgd) {
    return error(Code::kInvalidArgument, "optimizer config: unknown kind ",
                 static_cast<int>(c.kind));
  }
  STRATA_RETURN_IF_ERROR(check_finite("lr", c.lr, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("weight_decay", c.weight_decay, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("max_grad_norm", c.max_grad_norm, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("loss_scale", c.loss_scale, 0.f, false));
  if (c.kind == OptimizerKind::kAdamW) {
    for (auto [name, b] : {std::pair{"beta1", c.beta1}, std::pair{"beta2", c.beta2}}) {
      if (!(b >= 0.f && b < 1.f)) {
        return error(Code::kInvalidArgument, "optimizer config: ", name, " is ", b,
                     ", must be in [0, 1)");
      }
    }
    STRATA_RETURN_IF_ERROR(check_finite("eps", c.eps, 0.f, false));
  } else {
    STRATA_RETURN_IF_ERROR(check_finite("momentum", c.momentum, 0.f, true));
    STRATA_RETURN_IF_ERROR(check_finite("dampening", c.dampening, 0.f, true));
    if (c.nesterov && (c.momentum <= 0.f || c.dampening != 0.f)) {
      return error(Code::kInvalidArgument,
                   "optimizer config: nesterov needs momentum > 0 and dampening 0");
    }
  }
  if (c.explicit_updates &&
      (c.max_grad_norm > 0 || c.dynamic_loss_scale || c.accumulation_steps > 1)) {
    return error(Code::kInvalidArgument,
                 "optimizer config: explicit updates take max_grad_norm 0, no dynamic loss "
                 "scale and accumulation_steps 1 (the framework accumulates with its backward "
                 "passes, clips with strata_optimizer_grad_scale and decides when to step)");
  }
  if (c.dynamic_loss_scale) {
    if (!(c.growth_factor > 1.f) || !(c.backoff_factor > 0.f && c.backoff_factor < 1.f) ||
        c.growth_interval == 0) {
      return error(Code::kInvalidArgument,
                   "optimizer config: dynamic loss scaling needs growth_factor > 1, "
                   "0 < backoff_factor < 1 and growth_interval > 0");
    }
  }
  return Status::ok();
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

// One update's scalars for a group at update count t (the grad multiplied by grad_scale).
optim::AdamWScalars adamw_scalars(const OptimizerConfig& c, const GroupHyperparams& g, double t,
                                  float grad_scale) {
  // Bias corrections in double, as PyTorch computes them in Python floats.
  optim::AdamWScalars a;
  a.grad_scale = grad_scale;
  a.beta1 = c.beta1;
  a.beta2 = c.beta2;
  a.eps = c.eps;
  a.lr_decay = static_cast<float>(static_cast<double>(g.lr) * g.weight_decay);
  a.step_size = static_cast<float>(g.lr / (1.0 - std::pow(double{c.beta1}, t)));
  a.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{c.beta2}, t)));
  return a;
}

optim::SgdScalars sgd_scalars(const OptimizerConfig& c, const GroupHyperparams& g, uint64_t t,
                              float grad_scale) {
  optim::SgdScalars q;
  q.grad_scale = grad_scale;
  q.lr = g.lr;
  q.weight_decay = g.weight_decay;
  q.momentum = c.momentum;
  q.dampening = c.dampening;
  q.nesterov = c.nesterov;
  q.first_step = t == 1;
  return q;
}

}  // namespace

Optimizer::Optimizer(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config)
    : runtime_(std::move(runtime)), config_(config) {}

Status Optimizer::create(std::shared_ptr<Runtime> runtime, const OptimizerConfig& config,
                         std::shared_ptr<Optimizer>* out) {
  STRATA_RETURN_IF_ERROR(validate(config));
  if (!runtime->tier_available(Tier::kDram)) {
    return error(Code::kInvalidState, "the optimizer keeps its state in DRAM: no DRAM tier");
  }
  if (config.state_placement == StatePlacement::kOnNvme && !runtime->tier_available(Tier::kNvme)) {
    return error(Code::kInvalidState,
                 "optimizer config: state_placement STRATA_STATE_PLACEMENT_NVME needs an NVMe tier "
                 "(nvme_paths and nvme_budget_bytes in the runtime config)");
  }
  std::shared_ptr<Optimizer> o(new Optimizer(std::move(runtime), config));
  if (o->config_.accumulation_steps == 0) o->config_.accumulation_steps = 1;
  const int node = o->runtime_->device_numa_node();
  unsigned threads = o->config_.threads;
  if (threads > optim::WorkerPool::kMaxThreads) {
    return error(Code::kInvalidArgument, "optimizer config: threads ", threads,
                 " is over the limit of ", optim::WorkerPool::kMaxThreads);
  }
  if (threads == 0) {
    // One CPU of the node is left for the framework's thread, which feeds the GPU.
    const unsigned cpus = optim::WorkerPool::cpus_of_node(node);
    threads = cpus > 1 ? cpus - 1 : 1;
  }
  STRATA_RETURN_IF_ERROR(optim::WorkerPool::create(threads, node, &o->pool_));
  o->kernels_ = &optim::kernels(optim::best_isa());
  o->groups_.push_back(GroupHyperparams{o->config_.lr, o->config_.weight_decay});
  o->counters_.loss_scale = o->config_.loss_scale;
  STRATA_RETURN_IF_ERROR(spawn_thread(
      "the optimizer's dispatcher", [p = o.get()] { p->dispatcher_main(); }, &o->dispatcher_));
  *out = std::move(o);
  return Status::ok();
}

Optimizer::~Optimizer() {
  {
    std::unique_lock lock(mutex_);
    stopping_ = true;
    // Staging transfers call back into this object.
    cv_.wait(lock, [&] { return io_in_flight_ == 0; });
  }
  cv_.notify_all();
  if (dispatcher_.joinable()) dispatcher_.join();
  {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return io_in_flight_ == 0; });
  }
  free_staging();
  unregister_state();
}

void Optimizer::unregister_state() {
  for (TensorId id : pinned_) runtime_->unpin(id);
  pinned_.clear();
  for (TensorId id : owned_) (void)runtime_->unregister(id);
  owned_.clear();
}

Status Optimizer::make_state(const TensorRecord& weight, const char* suffix, uint64_t skew,
                             Tier home, TensorId* id, float** data) {
  TensorSpec spec;
  spec.name = state_name(weight.spec.name, suffix);
  spec.dtype = DType::kF32;
  spec.shape = weight.spec.shape;
  spec.role = Role::kOptimizerState;
  spec.home = home;
  Status s = runtime_->register_tensor(spec, id, home == Tier::kDram ? skew : 0);
  if (!s.is_ok()) {
    return error(s.code(), "optimizer state for '", weight.spec.name, "': ", s.message());
  }
  owned_.push_back(*id);
  STRATA_RETURN_IF_ERROR(runtime_->pin_in_place(*id, "optimizer"));
  pinned_.push_back(*id);
  TensorRecord r;
  STRATA_RETURN_IF_ERROR(runtime_->info(*id, &r));
  if (home == Tier::kDram) {
    *data = reinterpret_cast<float*>(runtime_->tier_base(Tier::kDram) + r.offset);
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
  // Page rounding and skews: a little more than `bytes` is allocated.
  const uint64_t need = bytes + bytes / 64 + 3 * 8192;
  const uint64_t free = dram.budget - dram.used;
  return dram.largest_free >= need && free >= need && free - need >= keep ? Tier::kDram
                                                                          : Tier::kNvme;
}

Status Optimizer::add_param(TensorId weight, TensorId grad, uint32_t group) {
  STRATA_RETURN_IF_ERROR(check_group(group));
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
  for (const TensorRecord* r : {&w, &g}) {
    const char* role = r == &w ? "weight" : "grad";
    if (r->tier != Tier::kDram) {
      return error(Code::kUnsupported, role, " '", r->spec.name, "' is in ", tier_name(r->tier),
                   ": the optimizer updates weights and reads grads in DRAM");
    }
    if (!optim::float_dtype(r->spec.dtype)) {
      return error(Code::kInvalidArgument, role, " '", r->spec.name, "' is ",
                   dtype_name(r->spec.dtype), ": the optimizer takes f32, bf16 or f16");
    }
  }
  if (element_count(w) != element_count(g)) {
    return error(Code::kInvalidArgument, "grad '", g.spec.name, "' has ", element_count(g),
                 " elements, weight '", w.spec.name, "' has ", element_count(w));
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
  a.grad = dram + g.offset;
  a.grad_dtype = g.spec.dtype;
  const bool adamw = config_.kind == OptimizerKind::kAdamW;
  const bool has_master = w.spec.dtype != DType::kF32;
  const bool has_avg = adamw || config_.momentum > 0.f;
  const uint64_t state_bytes =
      uint64_t{4} * n * ((has_master ? 1 : 0) + (has_avg ? 1 : 0) + (adamw ? 1 : 0));
  const Tier home = state_bytes == 0 ? Tier::kDram : state_home(state_bytes);
  p.nvme_state = home == Tier::kNvme;
  const uint64_t nvme_before = nvme_state_bytes_;
  auto roll_back_all = [&](Status s) {
    nvme_state_bytes_ = nvme_before;
    return roll_back(std::move(s));
  };
  // NVMe-homed state is written through a bounce buffer of its initial values.
  std::vector<float> init;
  auto write_initial = [&](TensorId id, bool widen) {
    init.assign(n, 0.f);
    if (widen) {
      const optim::ParamArrays w_view{init.data(), nullptr, nullptr,     a.weight, w.spec.dtype,
                                      init.data(), nullptr, DType::kF32, n};
      kernels_->accumulate(w_view, 0, n, true);
    }
    return runtime_->write(id, 0, init.data(), n * sizeof(float));
  };
  if (!has_master) {
    // The fp32 weight is its own master: no second copy to keep in step.
    p.master = weight;
    a.master = reinterpret_cast<float*>(dram + w.offset);
  } else {
    a.weight = dram + w.offset;
    a.weight_dtype = w.spec.dtype;
    Status s = make_state(w, ".master", kSkew[0], home, &p.master, &a.master);
    if (s.is_ok() && home == Tier::kNvme) s = write_initial(p.master, true);
    if (!s.is_ok()) return roll_back_all(s);
    if (home == Tier::kDram) {
      // The master starts as the working copy, exactly (bf16 and f16 widen without rounding).
      const optim::ParamArrays widen{a.master, nullptr, nullptr,     a.weight, w.spec.dtype,
                                     a.master, nullptr, DType::kF32, n};
      kernels_->accumulate(widen, 0, n, true);
    }
  }
  if (has_avg) {
    Status s = make_state(w, adamw ? ".exp_avg" : ".momentum_buffer", kSkew[1], home, &p.exp_avg,
                          &a.exp_avg);
    if (s.is_ok() && home == Tier::kNvme) s = write_initial(p.exp_avg, false);
    if (!s.is_ok()) return roll_back_all(s);
    if (home == Tier::kDram) std::memset(a.exp_avg, 0, n * sizeof(float));
  }
  if (adamw) {
    Status s = make_state(w, ".exp_avg_sq", kSkew[2], home, &p.exp_avg_sq, &a.exp_avg_sq);
    if (s.is_ok() && home == Tier::kNvme) s = write_initial(p.exp_avg_sq, false);
    if (!s.is_ok()) return roll_back_all(s);
    if (home == Tier::kDram) std::memset(a.exp_avg_sq, 0, n * sizeof(float));
  }
  if (config_.accumulation_steps > 1) {
    Status s = make_state(w, ".grad_accum", kSkew[3], Tier::kDram, &p.accum, &a.grad_accum);
    if (!s.is_ok()) return roll_back_all(s);
  }
  if (p.nvme_state) ++nvme_state_params_;
  if (group >= groups_.size()) groups_.resize(group + 1, groups_.front());
  params_.push_back(std::move(p));
  return Status::ok();
}

Status Optimizer::set_group(uint32_t group, const GroupHyperparams& h) {
  STRATA_RETURN_IF_ERROR(check_group(group));
  STRATA_RETURN_IF_ERROR(check_finite("lr", h.lr, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("weight_decay", h.weight_decay, 0.f, true));
  std::lock_guard lock(mutex_);
  if (group >= groups_.size()) groups_.resize(group + 1, groups_.front());
  groups_[group] = h;
  return Status::ok();
}

Status Optimizer::state_tensor(TensorId weight, StateKind kind, TensorId* out) {
  std::lock_guard lock(mutex_);
  for (const Param& p : params_) {
    if (p.weight != weight) continue;
    const TensorId id = kind == StateKind::kMaster     ? p.master
                        : kind == StateKind::kExpAvg   ? p.exp_avg
                        : kind == StateKind::kExpAvgSq ? p.exp_avg_sq
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

Status Optimizer::attach(Executor* executor) {
  std::vector<std::vector<std::size_t>> layer_params;
  {
    std::lock_guard lock(mutex_);
    if (executor_ != nullptr) return error(Code::kBusy, "the optimizer is already attached");
    if (params_.empty()) return error(Code::kInvalidState, "attach: the optimizer has no params");
    const Plan& plan = executor->plan();
    layer_params.resize(plan.layer_count);
    std::vector<int> layer_of(params_.size(), -1);
    for (uint32_t l = 0; l < plan.layer_count; ++l) {
      const LayerPlan& lp = plan.layers[l];
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const auto has = [](const std::vector<SlotTensor>& list, TensorId id) {
          return std::any_of(list.begin(), list.end(),
                             [&](const SlotTensor& t) { return t.id == id; });
        };
        if (!has(lp.weights, params_[i].weight)) continue;
        if (!has(lp.grads, params_[i].grad)) {
          TensorRecord g;
          (void)runtime_->info(params_[i].grad, &g);
          return error(Code::kInvalidArgument, "grad '", g.spec.name, "' is not a grad of layer ",
                       l, ", whose weight it belongs to: declare it in that layer's grads");
        }
        layer_of[i] = static_cast<int>(l);
        layer_params[l].push_back(i);
      }
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (layer_of[i] < 0) {
        TensorRecord w;
        (void)runtime_->info(params_[i].weight, &w);
        return error(Code::kInvalidArgument, "weight '", w.spec.name,
                     "' is not a weight of any layer of the executor's graph (an attached "
                     "optimizer updates layer weights as their grads land)");
      }
    }
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].layer = layer_of[i];
    for (const auto& lp : layer_params) {
      for (std::size_t k = 0; k < lp.size(); ++k) params_[lp[k]].in_layer = k;
    }
    layer_params_ = layer_params;
    layer_tasks_.clear();
    layers_with_params_ = 0;
    for (const auto& lp : layer_params_) {
      layer_tasks_.push_back(tasks_for(lp));
      if (!lp.empty()) ++layers_with_params_;
    }
    pending_.assign(plan.layer_count, 0);
    landing_.assign(plan.layer_count, 0);
    grads_in_ = 0;
    STRATA_RETURN_IF_ERROR(layout_stages());
    executor_ = executor;
  }
  // Outside mutex_: the executor calls the hooks under its own lock, so it is always taken first.
  Status s = executor->attach_hooks(shared_from_this());
  if (!s.is_ok()) {
    std::lock_guard lock(mutex_);
    executor_ = nullptr;
    free_staging();
  }
  return s;
}

Status Optimizer::layout_stages() {
  free_staging();
  stages_.assign(layer_params_.size(), LayerStage{});
  nvme_layers_ = 0;
  if (nvme_state_params_ == 0) return Status::ok();
  uint64_t largest = 0;
  std::size_t largest_layer = 0;
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    LayerStage& st = stages_[l];
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      if (!p.nvme_state) continue;
      const TensorId ids[3] = {p.master == p.weight ? TensorId{0} : p.master, p.exp_avg,
                               p.exp_avg_sq};
      for (int k = 0; k < 3; ++k) {
        if (ids[k] == 0) continue;
        TensorRecord r;
        STRATA_RETURN_IF_ERROR(runtime_->info(ids[k], &r));
        StagedTensor t;
        t.id = ids[k];
        t.name = r.spec.name;
        t.extent = r.offset;
        t.len = Arena::round_up(r.nbytes, NvmeTier::kAlignment);
        t.crcs = r.nvme_crcs;
        t.offset = st.bytes;
        t.param = i;
        t.kind = k;
        st.bytes += t.len;
        st.tensors.push_back(std::move(t));
      }
    }
    if (st.tensors.empty()) continue;
    ++nvme_layers_;
    if (st.bytes > largest) {
      largest = st.bytes;
      largest_layer = l;
    }
  }
  if (nvme_layers_ == 0) return Status::ok();
  const TierUsage dram = runtime_->tier_usage(Tier::kDram);
  uint64_t room = dram.largest_free;
  if (config_.nvme_staging_bytes != 0) room = std::min(room, config_.nvme_staging_bytes);
  const std::size_t slots = static_cast<std::size_t>(
      std::min<uint64_t>({room / largest, kMaxStagingSlots, nvme_layers_}));
  if (slots == 0) {
    return error(Code::kOutOfMemory, "optimizer: layer ", largest_layer, "'s state on NVMe (",
                 largest, " bytes) must be staged in DRAM for its update, and ", room,
                 " bytes are free for staging (largest free DRAM block ", dram.largest_free,
                 ", nvme_staging_bytes ", config_.nvme_staging_bytes,
                 "): raise the DRAM budget or nvme_staging_bytes");
  }
  static std::atomic<uint64_t> serial{0};
  TensorSpec spec;
  spec.name = "strata.optimizer." + std::to_string(serial.fetch_add(1)) + ".nvme_staging";
  spec.dtype = DType::kU8;
  spec.shape = {static_cast<int64_t>(slots * largest)};
  spec.role = Role::kOptimizerState;
  spec.home = Tier::kDram;
  Status s = runtime_->register_tensor(spec, &staging_id_);
  if (!s.is_ok()) {
    return error(s.code(), "optimizer: staging for NVMe-homed state (", slots, " x ", largest,
                 " bytes): ", s.message());
  }
  TensorRecord r;
  (void)runtime_->info(staging_id_, &r);
  (void)runtime_->pin_in_place(staging_id_, "optimizer staging");
  staging_base_ = runtime_->tier_base(Tier::kDram) + r.offset;
  slot_bytes_ = largest;
  slot_free_.assign(slots, 1);
  staging_bytes_ = slots * largest;
  return Status::ok();
}

void Optimizer::free_staging() {
  if (staging_id_ != 0) {
    runtime_->unpin(staging_id_);
    (void)runtime_->unregister(staging_id_);
  }
  staging_id_ = 0;
  staging_base_ = nullptr;
  slot_bytes_ = 0;
  slot_free_.clear();
  staging_bytes_ = 0;
}

bool Optimizer::needs_stage(const Job& job) const {
  if (job.kind != JobKind::kUpdate || job.layer < 0) return false;
  const auto l = static_cast<std::size_t>(job.layer);
  return l < stages_.size() && !stages_[l].tensors.empty();
}

bool Optimizer::stage_ready(const Job& job) const {
  // After a failure nothing is staged any more: the job runs to report it.
  return !needs_stage(job) || !failure_.is_ok() ||
         stages_[static_cast<std::size_t>(job.layer)].phase == StagePhase::kStaged;
}

void Optimizer::release_slot(std::size_t layer) {
  LayerStage& st = stages_[layer];
  if (st.slot >= 0) slot_free_[static_cast<std::size_t>(st.slot)] = 1;
  st.slot = -1;
  st.phase = StagePhase::kIdle;
  st.ahead = false;
  for (const StagedTensor& x : st.tensors) {
    params_[x.param].staged[static_cast<std::size_t>(x.kind)] = nullptr;
  }
}

int Optimizer::free_slot() const {
  const auto f = std::find(slot_free_.begin(), slot_free_.end(), uint8_t{1});
  return f == slot_free_.end() ? -1 : static_cast<int>(f - slot_free_.begin());
}

int Optimizer::take_slot(const std::vector<std::size_t>& queued_layers) {
  if (const int slot = free_slot(); slot >= 0) return slot;
  // A layer read ahead whose update is not queued yet gives its slot up (its copy is clean):
  // the farthest from being needed.
  for (std::size_t k = stages_.size(); k-- > 0;) {
    const std::size_t l = ahead_descending_ ? stages_.size() - 1 - k : k;
    LayerStage& st = stages_[l];
    if (st.phase != StagePhase::kStaged || !st.ahead || !st.status.is_ok()) continue;
    if (std::find(queued_layers.begin(), queued_layers.end(), l) != queued_layers.end()) continue;
    const int slot = st.slot;
    release_slot(l);
    return slot;
  }
  return -1;
}

std::vector<Optimizer::StageIo> Optimizer::stage_more() {
  std::vector<StageIo> ios;
  if (nvme_layers_ == 0 || !failure_.is_ok()) return ios;
  // The layers whose first queued update needs its state, lowest first: the order pick_job
  // runs them in.
  std::vector<std::size_t> queued;
  for (const Job& j : queue_) {
    if (!needs_stage(j)) continue;
    const auto l = static_cast<std::size_t>(j.layer);
    if (std::find(queued.begin(), queued.end(), l) == queued.end()) queued.push_back(l);
  }
  std::sort(queued.begin(), queued.end());
  std::vector<std::size_t> want;
  for (std::size_t l : queued) {
    if (stages_[l].phase == StagePhase::kIdle) want.push_back(l);
  }
  std::size_t needed = want.size();
  if (ahead_round_ != 0) {
    // Then, with the slots left, the layers the updates of this step will need, read during
    // its backward pass (each once per step).
    for (std::size_t k = 0; k < stages_.size(); ++k) {
      const std::size_t l = ahead_descending_ ? stages_.size() - 1 - k : k;
      const LayerStage& st = stages_[l];
      if (st.tensors.empty() || st.phase != StagePhase::kIdle || st.round == ahead_round_ ||
          std::find(want.begin(), want.end(), l) != want.end()) {
        continue;
      }
      want.push_back(l);
    }
  }
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::size_t l = want[i];
    const bool ahead = i >= needed;
    // Reading ahead takes only a free slot; a queued update may take one back.
    const int slot = ahead ? free_slot() : take_slot(queued);
    if (slot < 0) {
      if (ahead) break;
      continue;
    }
    slot_free_[static_cast<std::size_t>(slot)] = 0;
    LayerStage& st = stages_[l];
    st.slot = slot;
    st.phase = StagePhase::kReading;
    st.status = Status::ok();
    st.ahead = ahead;
    if (ahead) st.round = ahead_round_;
    unsigned char* base = staging_base_ + static_cast<uint64_t>(st.slot) * slot_bytes_;
    for (std::size_t k = 0; k < st.tensors.size(); ++k) {
      const StagedTensor& t = st.tensors[k];
      params_[t.param].staged[static_cast<std::size_t>(t.kind)] =
          reinterpret_cast<float*>(base + t.offset);
      ios.push_back(StageIo{false, static_cast<uint32_t>(l), k});
    }
    st.outstanding = static_cast<int>(st.tensors.size());
    io_in_flight_ += st.outstanding;
  }
  return ios;
}

void Optimizer::start_io(const std::vector<StageIo>& ios) {
  // Nothing to start: touch nothing (a transfer's callback may run this after the last
  // transfer ended, when the optimizer may already be going away).
  if (ios.empty()) return;
  NvmeTier* nvme = runtime_->nvme_tier();
  for (const StageIo& io : ios) {
    const LayerStage& st = stages_[io.layer];
    const StagedTensor& t = st.tensors[io.tensor];
    // The slot and layout do not change while the transfer is outstanding.
    unsigned char* host = staging_base_ + static_cast<uint64_t>(st.slot) * slot_bytes_ + t.offset;
    auto done = [this, io](Status s) { on_stage_io(io, std::move(s)); };
    if (io.write) {
      nvme->write_from_host(t.name, host, t.extent, t.len, t.crcs, done);
    } else {
      nvme->read_to_host(t.name, host, t.extent, t.len, t.crcs, done);
    }
  }
}

void Optimizer::on_stage_io(const StageIo& io, Status s) {
  std::vector<StageIo> more;
  {
    std::lock_guard lock(mutex_);
    LayerStage& st = stages_[io.layer];
    const StagedTensor& t = st.tensors[io.tensor];
    --io_in_flight_;
    if (s.is_ok()) {
      (io.write ? nvme_write_bytes_ : nvme_read_bytes_) += t.len;
    } else if (st.status.is_ok()) {
      st.status =
          error(s.code(), "optimizer: ", io.write ? "writing" : "reading", " the state '", t.name,
                "' of layer ", io.layer, io.write ? " to" : " from", " NVMe: ", s.message());
      fail(st.status);
    }
    if (--st.outstanding == 0) {
      if (io.write) {
        // Written back: the slot is free for the next layer.
        release_slot(io.layer);
        more = stage_more();
      } else {
        // Read in (or failed: the update then runs no kernels and finish_stage frees the slot).
        st.phase = StagePhase::kStaged;
      }
    }
    // Under the lock: once io_in_flight_ is 0 the destructor may run, and this thread must
    // not touch cv_ after that (start_io below runs only with transfers counted in flight).
    cv_.notify_all();
  }
  start_io(more);
}

std::vector<Optimizer::StageIo> Optimizer::finish_stage(std::size_t layer, bool dirty) {
  LayerStage& st = stages_[layer];
  std::vector<StageIo> ios;
  st.ahead = false;
  st.round = ahead_round_;  // updated this round: not read ahead again in it
  if (dirty && st.status.is_ok() && !stopping_) {
    st.phase = StagePhase::kWriting;
    st.outstanding = static_cast<int>(st.tensors.size());
    io_in_flight_ += st.outstanding;
    for (std::size_t k = 0; k < st.tensors.size(); ++k) {
      ios.push_back(StageIo{true, static_cast<uint32_t>(layer), k});
    }
    return ios;
  }
  // Unchanged (a skipped step) or failed: nothing to write back. A layer whose reads are
  // still in flight (the optimizer failed meanwhile) keeps its slot until they end.
  if (st.phase == StagePhase::kReading || st.phase == StagePhase::kWriting) return ios;
  release_slot(layer);
  return stage_more();
}

optim::ParamArrays Optimizer::update_arrays(const Param& p) const {
  optim::ParamArrays a = p.arrays;
  if (p.nvme_state) {
    if (p.master != p.weight) a.master = p.staged[0];
    if (p.exp_avg != 0) a.exp_avg = p.staged[1];
    if (p.exp_avg_sq != 0) a.exp_avg_sq = p.staged[2];
  }
  return a;
}

Status Optimizer::detach() {
  Executor* e = nullptr;
  {
    std::lock_guard lock(mutex_);
    e = executor_;
  }
  if (e == nullptr) return Status::ok();
  STRATA_RETURN_IF_ERROR(e->detach_hooks(this));
  Status s = synchronize();
  std::lock_guard lock(mutex_);
  executor_ = nullptr;
  return s;
}

void Optimizer::on_executor_destroyed() {
  std::lock_guard lock(mutex_);
  executor_ = nullptr;
}

void Optimizer::fail(Status s) {
  if (failure_.is_ok()) failure_ = std::move(s);
}

void Optimizer::wait_for_norms(std::unique_lock<std::mutex>& lock) {
  cv_.wait(lock, [&] {
    return !failure_.is_ok() || !current_ || !deferred() ||
           current_->norms_in >= layers_with_params_ || grads_in_ < layers_with_params_;
  });
}

Status Optimizer::on_step_begin() {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  // A deferred step settles t and the loss scale when its last norm is in: wait for that (a
  // few milliseconds after the previous step's last grads landed, and before this step's first
  // load could start anyway, since that waits for its layer's update), so this step's values
  // and what the framework reads from the stats are settled.
  wait_for_norms(lock);
  if (!failure_.is_ok()) return failure_;
  in_executor_step_ = true;
  if (config_.explicit_updates) {
    // Grads held in the grad tensors would be overwritten by this step's: move them to the
    // fp32 accumulators first (the layer's load, and so its backward, waits for that).
    for (std::size_t l = 0; l < layer_params_.size(); ++l) {
      Job job;
      job.kind = JobKind::kStash;
      job.layer = static_cast<int>(l);
      bool any = false;
      for (std::size_t i : layer_params_[l]) {
        Param& p = params_[i];
        const bool move = p.hold == GradHold::kGrad;
        if (move) {
          Status s = ensure_accum(p);
          if (!s.is_ok()) {
            in_executor_step_ = false;
            return s;
          }
          p.hold = GradHold::kAccum;
        }
        job.add.push_back(move ? 1 : 0);
        job.mult.push_back(p.grad_mult);
        if (move) p.grad_mult = 1.f;
        any = any || move;
      }
      if (!any) continue;
      job.sums.assign(layer_params_[l].size(), 0.0);
      ++pending_[l];
      ++landing_[l];
      queue_.push_back(std::move(job));
    }
    // The updates step() will queue run in forward order.
    const std::vector<StageIo> reads = read_ahead(false);
    lock.unlock();
    cv_.notify_all();
    start_io(reads);
    return Status::ok();
  }
  final_micro_ = micro_ + 1 >= config_.accumulation_steps;
  grads_in_ = 0;
  std::vector<StageIo> reads;
  if (final_micro_) {
    auto s = std::make_shared<StepScalars>();
    s->t = counters_.step + 1;
    s->grad_scale = 1.f / counters_.loss_scale;
    s->groups = groups_;
    current_ = std::move(s);
    // Updates follow the grads (backward order) or, deferred, run in forward order.
    reads = read_ahead(!deferred());
  }
  lock.unlock();
  start_io(reads);
  return Status::ok();
}

std::vector<Optimizer::StageIo> Optimizer::read_ahead(bool descending) {
  if (nvme_layers_ == 0) return {};
  ahead_round_ = ++rounds_;
  ahead_descending_ = descending;
  return stage_more();
}

Status Optimizer::on_grads_queued(uint32_t layer,
                                  std::vector<std::shared_ptr<DeviceFence>> landed) {
  {
    std::lock_guard lock(mutex_);
    if (!failure_.is_ok()) return failure_;
    if (layer >= layer_params_.size() || layer_params_[layer].empty()) return Status::ok();
    Job job;
    job.layer = static_cast<int>(layer);
    job.landed = std::move(landed);
    job.scalars = current_;
    if (config_.explicit_updates) {
      job.kind = JobKind::kLand;
      for (std::size_t i : layer_params_[layer]) {
        Param& p = params_[i];
        if (p.hold == GradHold::kGrad) {
          return error(Code::kInvalidState, "optimizer: layer ", layer,
                       "'s grads landed twice without a step_begin between");
        }
        const bool add = p.hold == GradHold::kAccum;
        job.add.push_back(add ? 1 : 0);
        job.mult.push_back(p.grad_mult);
        if (!add) p.hold = GradHold::kGrad;
        p.grad_mult = 1.f;
      }
      job.sums.assign(layer_params_[layer].size(), 0.0);
      ++pending_[layer];
      ++landing_[layer];
      queue_.push_back(std::move(job));
      cv_.notify_all();
      return Status::ok();
    }
    if (!final_micro_) {
      job.kind = JobKind::kAccumulate;
      job.first_micro = micro_ == 0;
    } else {
      // Deferred: the norm now, the update (counted as pending from now) after the last norm.
      job.kind = deferred() ? JobKind::kNorm : JobKind::kUpdate;
    }
    ++pending_[layer];
    queue_.push_back(std::move(job));
    if (++grads_in_ == layers_with_params_) {
      // The step's last grads are queued: the next executor step is the next micro-step.
      if (final_micro_) {
        micro_ = 0;
        if (!deferred()) counters_.step = current_->t;
      } else {
        ++micro_;
      }
    }
  }
  cv_.notify_all();
  return Status::ok();
}

void Optimizer::on_step_end() {
  std::lock_guard lock(mutex_);
  in_executor_step_ = false;
}

void Optimizer::on_step_aborted() {
  {
    std::lock_guard lock(mutex_);
    in_executor_step_ = false;
    if (!config_.explicit_updates && grads_in_ > 0 && grads_in_ < layers_with_params_) {
      // Part of an automatic step's grads came: what they started (accumulation, updates,
      // norms) runs to its end, and the next step starts afresh. A deferred step's norms
      // never complete: its norm jobs release their layers themselves.
      if (current_ && deferred() && final_micro_) {
        current_->aborted = true;
        for (int l : current_->normed) --pending_[static_cast<std::size_t>(l)];
        current_->normed.clear();
      }
      micro_ = 0;
    }
    grads_in_ = 0;
  }
  cv_.notify_all();
}

Status Optimizer::ensure_accum(Param& p) {
  if (p.accum != 0) return Status::ok();
  TensorRecord w;
  STRATA_RETURN_IF_ERROR(runtime_->info(p.weight, &w));
  Status s = make_state(w, ".grad_accum", kSkew[3], Tier::kDram, &p.accum, &p.accum_data);
  if (!s.is_ok()) {
    return error(s.code(),
                 "gradient accumulation (a backward pass onto grads not zeroed since the last "
                 "one) needs an fp32 sum per parameter: ",
                 s.message());
  }
  return Status::ok();
}

Status Optimizer::held_grad(TensorId weight, std::unique_lock<std::mutex>& lock, Param** out) {
  if (!config_.explicit_updates) {
    return error(Code::kInvalidState,
                 "per-parameter grads exist in explicit update mode only (update_mode "
                 "STRATA_UPDATE_EXPLICIT); this optimizer updates from executor steps");
  }
  if (executor_ == nullptr) {
    return error(Code::kInvalidState, "per-parameter grads: the optimizer is not attached");
  }
  Param* param = nullptr;
  for (Param& p : params_) {
    if (p.weight == weight) param = &p;
  }
  if (param == nullptr)
    return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
  const auto layer = static_cast<std::size_t>(param->layer);
  cv_.wait(lock, [&] { return !failure_.is_ok() || landing_[layer] == 0; });
  STRATA_RETURN_IF_ERROR(failure_);
  *out = param;
  return Status::ok();
}

Status Optimizer::grad_info(TensorId weight, GradInfo* out) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  out->has_grad = p->hold != GradHold::kNone;
  const double m = p->grad_mult;
  out->sum_squares =
      p->hold == GradHold::kNone || p->hold == GradHold::kZero ? 0.0 : p->grad_sq * m * m;
  out->step = p->t;
  return Status::ok();
}

Status Optimizer::grad_read(TensorId weight, float* dst, uint64_t count) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  if (count != p->arrays.count) {
    return error(Code::kInvalidArgument, "grad_read: ", count,
                 " elements asked, the parameter has ", p->arrays.count);
  }
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_read: the parameter holds no grad (zeroed to none)");
  }
  if (p->hold == GradHold::kZero) {
    std::fill(dst, dst + count, 0.f);
    return Status::ok();
  }
  optim::ParamArrays a;
  a.grad = p->hold == GradHold::kAccum ? static_cast<const void*>(p->accum_data) : p->arrays.grad;
  a.grad_dtype = p->hold == GradHold::kAccum ? DType::kF32 : p->arrays.grad_dtype;
  a.grad_accum = dst;
  a.count = count;
  kernels_->accumulate(a, 0, count, true);  // widen to fp32 into dst
  if (p->grad_mult != 1.f) {
    for (uint64_t i = 0; i < count; ++i) dst[i] *= p->grad_mult;
  }
  return Status::ok();
}

Status Optimizer::grad_scale(TensorId weight, float factor) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  if (p->hold == GradHold::kNone) {
    return error(Code::kInvalidState, "grad_scale: the parameter holds no grad");
  }
  p->grad_mult *= factor;
  return Status::ok();
}

Status Optimizer::grad_zero(TensorId weight, bool keep_zeros) {
  std::unique_lock lock(mutex_);
  Param* p = nullptr;
  STRATA_RETURN_IF_ERROR(held_grad(weight, lock, &p));
  p->hold = keep_zeros ? GradHold::kZero : GradHold::kNone;
  p->grad_mult = 1.f;
  p->grad_sq = 0;
  return Status::ok();
}

Status Optimizer::set_param_step(TensorId weight, uint64_t step) {
  std::unique_lock lock(mutex_);
  if (!config_.explicit_updates) {
    return error(Code::kInvalidState,
                 "per-parameter update counts exist in explicit update mode only");
  }
  for (Param& p : params_) {
    if (p.weight != weight) continue;
    // Updates queued with the old count must not be overtaken.
    const auto layer = p.layer;
    cv_.wait(lock, [&] {
      return !failure_.is_ok() || layer < 0 || pending_[static_cast<std::size_t>(layer)] == 0;
    });
    STRATA_RETURN_IF_ERROR(failure_);
    p.t = step;
    return Status::ok();
  }
  return error(Code::kNotFound, "the tensor is not a parameter of this optimizer");
}

bool Optimizer::layer_ready(uint32_t layer) {
  std::lock_guard lock(mutex_);
  return failure_.is_ok() && (layer >= pending_.size() || pending_[layer] == 0);
}

Status Optimizer::wait_layer(uint32_t layer) {
  std::unique_lock lock(mutex_);
  cv_.wait(lock,
           [&] { return !failure_.is_ok() || layer >= pending_.size() || pending_[layer] == 0; });
  return failure_;
}

Status Optimizer::synchronize() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] {
    if (!failure_.is_ok()) return true;
    if (!queue_.empty() || running_ > 0 || io_in_flight_ > 0) return false;
    return std::all_of(pending_.begin(), pending_.end(), [](int p) { return p == 0; });
  });
  if (failure_.is_ok()) {
    // State read ahead is dropped: after synchronize the NVMe copy is the only one, so the
    // caller may read or write it (the next executor step reads ahead again).
    ahead_round_ = 0;
    for (std::size_t l = 0; l < stages_.size(); ++l) {
      if (stages_[l].phase == StagePhase::kStaged) release_slot(l);
    }
  }
  return failure_;
}

void Optimizer::finish_norms(double total_squared, StepScalars* s) {
  const float scale = counters_.loss_scale;
  last_norm_ = std::sqrt(total_squared) / scale;
  if (!std::isfinite(total_squared)) {
    // Overflowed grads: no update this step (t does not advance), and a smaller scale.
    s->skip = true;
    ++counters_.skipped_steps;
    if (config_.dynamic_loss_scale) {
      counters_.loss_scale = scale * config_.backoff_factor;
      counters_.growth_tracker = 0;
    }
    return;
  }
  double coef = 1.0;
  if (config_.max_grad_norm > 0) {
    // PyTorch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
    coef = std::min(1.0, static_cast<double>(config_.max_grad_norm) / (last_norm_ + 1e-6));
  }
  s->grad_scale = static_cast<float>(coef / scale);
  counters_.step = s->t;
  if (config_.dynamic_loss_scale && ++counters_.growth_tracker >= config_.growth_interval) {
    counters_.loss_scale = scale * config_.growth_factor;
    counters_.growth_tracker = 0;
  }
}

double Optimizer::run_tasks(std::span<const Task> tasks, JobKind kind, const StepScalars* s,
                            bool first) {
  std::vector<double> sums(kind == JobKind::kNorm ? tasks.size() : 0);
  std::vector<optim::AdamWScalars> adam_groups;
  std::vector<optim::SgdScalars> sgd_groups;
  if (kind == JobKind::kUpdate) {
    const double t = static_cast<double>(s->t);
    for (const GroupHyperparams& g : s->groups) {
      if (config_.kind == OptimizerKind::kAdamW) {
        adam_groups.push_back(adamw_scalars(config_, g, t, s->grad_scale));
      } else {
        sgd_groups.push_back(sgd_scalars(config_, g, s->t, s->grad_scale));
      }
    }
  }
  pool_->run(tasks.size(), [&](std::size_t k) {
    const Task& task = tasks[k];
    const Param& p = params_[task.param];
    switch (kind) {
      case JobKind::kAccumulate:
        kernels_->accumulate(p.arrays, task.begin, task.end, first);
        break;
      case JobKind::kNorm:
        sums[k] = kernels_->sum_squares(p.arrays, task.begin, task.end);
        break;
      case JobKind::kUpdate: {
        const optim::ParamArrays a = update_arrays(p);
        if (config_.kind == OptimizerKind::kAdamW) {
          kernels_->adamw(adam_groups[p.group], a, task.begin, task.end);
        } else {
          kernels_->sgd(sgd_groups[p.group], a, task.begin, task.end);
        }
        break;
      }
      case JobKind::kLand:
      case JobKind::kStash:
        break;  // explicit mode: run_explicit
    }
  });
  double total = 0;
  for (double v : sums) total += v;
  return total;
}

uint64_t Optimizer::job_bytes(std::span<const Task> tasks, JobKind kind) const {
  uint64_t bytes = 0;
  for (const Task& t : tasks) {
    const optim::ParamArrays& a = params_[t.param].arrays;
    const uint64_t n = t.end - t.begin;
    uint64_t per = dtype_size(a.grad_dtype) + (a.grad_accum != nullptr ? 4 : 0);
    if (kind == JobKind::kAccumulate) per = dtype_size(a.grad_dtype) + 8;
    if (kind == JobKind::kUpdate) {
      per += 8;  // master read and write
      if (a.exp_avg != nullptr) per += 8;
      if (a.exp_avg_sq != nullptr) per += 8;
      if (a.weight != nullptr) per += dtype_size(a.weight_dtype);
    }
    bytes += n * per;
  }
  return bytes;
}

std::size_t Optimizer::pick_job() const {
  // Earliest deadline first: the next step's forward pass loads layer 0 first, so among the
  // jobs whose grads have landed the lowest layer goes first. During the backward pass that is
  // the layer that just landed, so a backlog the pass could not absorb is left in the highest
  // layers, which the next forward pass needs last; first-come order would leave it in layer
  // 0, which the next step needs first (on the H200, a step whose updates outlasted its
  // backward pass grew 15% with first-come order).
  // A layer's jobs run in the order they were queued (a grad lands, is stashed, updates), so
  // only the first queued job of each layer is a candidate.
  std::size_t best = queue_.size();
  std::vector<int> seen;
  for (std::size_t i = 0; i < queue_.size(); ++i) {
    const Job& j = queue_[i];
    if (std::find(seen.begin(), seen.end(), j.layer) != seen.end()) continue;
    seen.push_back(j.layer);
    if (best < queue_.size() && queue_[best].layer <= j.layer) continue;
    const bool landed =
        std::all_of(j.landed.begin(), j.landed.end(), [](const auto& f) { return f->is_done(); });
    if (landed && stage_ready(j)) best = i;
  }
  return best;
}

void Optimizer::dispatcher_main() {
  for (;;) {
    Job job;
    bool picked = false;
    std::vector<std::shared_ptr<DeviceFence>> oldest;
    std::vector<StageIo> reads;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to finish
      reads = stage_more();
      const std::size_t pick = pick_job();
      if (pick == queue_.size()) {
        // Nothing ready: wait for the first grads still landing, else (every landed job waits
        // for its state from NVMe) for a staging transfer to finish.
        for (const Job& j : queue_) {
          const bool landed = std::all_of(j.landed.begin(), j.landed.end(),
                                          [](const auto& f) { return f->is_done(); });
          if (!landed) {
            oldest = j.landed;
            break;
          }
        }
        if (oldest.empty() && reads.empty()) {
          // Every landed job waits for its state: a staging transfer's end notifies. (With
          // none in flight, a fence landed since pick_job looked: pick again.)
          if (io_in_flight_ > 0) {
            const auto t0 = std::chrono::steady_clock::now();
            cv_.wait(lock);
            stage_wait_seconds_ += seconds_since(t0);
          }
          continue;
        }
      } else {
        job = std::move(queue_[pick]);
        queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(pick));
        ++running_;
        picked = true;
        // Its state, if read ahead, is now in use: no longer a slot take_slot may take back.
        if (needs_stage(job)) stages_[static_cast<std::size_t>(job.layer)].ahead = false;
      }
    }
    start_io(reads);
    if (!oldest.empty()) {
      for (const auto& f : oldest) (void)f->host_wait();  // errors: reported when it runs
      continue;
    }
    if (!picked) continue;
    Status status;
    for (const auto& f : job.landed) {
      Status s = f->host_wait();
      if (status.is_ok() && !s.is_ok()) status = s;
    }
    const bool staged = needs_stage(job);
    Status stage_status;
    if (staged) {
      std::lock_guard lock(mutex_);
      const LayerStage& st = stages_[static_cast<std::size_t>(job.layer)];
      stage_status = st.phase == StagePhase::kStaged ? st.status : failure_;
    }
    const std::vector<Task>& tasks = layer_tasks_[static_cast<std::size_t>(job.layer)];
    double norm = 0;
    double seconds = 0;
    bool preempted = false;
    const bool skip = job.kind == JobKind::kUpdate && job.scalars && job.scalars->skip;
    // Updates and accumulation run in slices of about one task per thread; between slices a
    // lower layer whose grads have landed takes over (the rest of this job goes back to the
    // queue). Without that, layer 0's update, which lands last and is needed first, waited for
    // whatever higher layer the pool had just started. Norms are short and run whole.
    const std::size_t slice = job.kind == JobKind::kNorm ? tasks.size() : pool_->size();
    const bool explicit_job =
        !job.sources.empty() || job.kind == JobKind::kLand || job.kind == JobKind::kStash;
    while (status.is_ok() && stage_status.is_ok() && !skip && job.next_task < tasks.size()) {
      const std::size_t n = std::min(slice, tasks.size() - job.next_task);
      const std::span<const Task> part(tasks.data() + job.next_task, n);
      Tracer& tracer = runtime_->tracer();
      const uint64_t trace_start = tracer.enabled() ? tracer.now() : 0;
      const auto t0 = std::chrono::steady_clock::now();
      if (explicit_job) {
        run_explicit(part, job);
      } else {
        norm += run_tasks(part, job.kind, job.scalars.get(), job.first_micro);
      }
      seconds += seconds_since(t0);
      if (tracer.enabled()) {
        TraceRecord r;
        r.kind = static_cast<int32_t>(TraceKind::kOptimizer);
        r.start_ns = trace_start;
        r.end_ns = tracer.now();
        r.bytes = job_bytes(part, job.kind);
        r.layer = job.layer;
        r.phase = static_cast<int32_t>(job.kind);
        tracer.record(r);
      }
      job.next_task += n;
      if (job.next_task < tasks.size() && job.kind != JobKind::kNorm) {
        std::lock_guard lock(mutex_);
        const std::size_t pick = pick_job();
        if (pick < queue_.size() && queue_[pick].layer < job.layer) {
          update_seconds_ += seconds;
          --running_;
          // At the front: it stays ahead of any later job of its layer (pick_job keeps each
          // layer's jobs in queue order).
          queue_.push_front(std::move(job));
          preempted = true;
          break;
        }
      }
    }
    if (preempted) continue;
    std::vector<StageIo> writes;
    {
      std::lock_guard lock(mutex_);
      update_seconds_ += seconds;
      --running_;
      if (staged) {
        writes = finish_stage(static_cast<std::size_t>(job.layer),
                              status.is_ok() && stage_status.is_ok() && !skip);
      }
      if (!status.is_ok()) {
        fail(error(status.code(), "optimizer: grads of layer ", job.layer,
                   " did not land: ", status.message()));
      }
      if (job.kind == JobKind::kLand || job.kind == JobKind::kStash) {
        const auto l = static_cast<std::size_t>(job.layer);
        for (std::size_t k = 0; k < layer_params_[l].size(); ++k) {
          Param& p = params_[layer_params_[l][k]];
          // A kStash entry that moved nothing leaves the param's sum as it was.
          if (job.kind == JobKind::kLand || job.add[k] != 0) p.grad_sq = job.sums[k];
        }
        --landing_[l];
        --pending_[l];
      } else if (job.kind == JobKind::kNorm && job.scalars->aborted) {
        --pending_[static_cast<std::size_t>(job.layer)];  // its update will never be queued
      } else if (job.kind == JobKind::kNorm) {
        StepScalars& step = *job.scalars;
        step.norm_squared += norm;
        step.normed.push_back(job.layer);
        if (++step.norms_in == layers_with_params_) {
          // Every grad is in: decide the step, then update in forward order, which is the
          // order the next step's forward pass loads the layers in.
          finish_norms(step.norm_squared, &step);
          for (std::size_t l = 0; l < layer_params_.size(); ++l) {
            if (layer_params_[l].empty()) continue;
            Job u;
            u.kind = JobKind::kUpdate;
            u.layer = static_cast<int>(l);
            u.scalars = job.scalars;
            queue_.push_back(std::move(u));
          }
        }
      } else {
        --pending_[static_cast<std::size_t>(job.layer)];
      }
    }
    cv_.notify_all();
    start_io(writes);
  }
}

namespace {

// Elements [begin, end) of `a` as arrays of their own, starting at element 0.
optim::ParamArrays subarray(const optim::ParamArrays& a, std::size_t begin, std::size_t end) {
  auto at = [begin](auto* p, DType d) {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(p)>>,
                                    const unsigned char, unsigned char>;
    return p == nullptr
               ? p
               : reinterpret_cast<decltype(p)>(reinterpret_cast<Byte*>(p) + begin * dtype_size(d));
  };
  optim::ParamArrays s = a;
  s.master = at(a.master, DType::kF32);
  s.exp_avg = at(a.exp_avg, DType::kF32);
  s.exp_avg_sq = at(a.exp_avg_sq, DType::kF32);
  s.grad = at(a.grad, a.grad_dtype);
  s.grad_accum = at(a.grad_accum, DType::kF32);
  s.weight = at(a.weight, a.weight_dtype);
  s.count = end - begin;
  return s;
}

}  // namespace

void Optimizer::run_explicit(std::span<const Task> tasks, Job& job) {
  std::vector<double> sums(tasks.size(), 0.0);
  pool_->run(tasks.size(), [&](std::size_t k) {
    const Task& task = tasks[k];
    const Param& p = params_[task.param];
    const std::size_t b = task.begin, e = task.end;
    const std::size_t slot = p.in_layer;
    // Views built from the fields fixed at add_param, plus the accumulator where the job
    // uses it (it was allocated before the job was queued).
    optim::ParamArrays grad_view;  // the landed grad
    grad_view.grad = p.arrays.grad;
    grad_view.grad_dtype = p.arrays.grad_dtype;
    grad_view.count = p.arrays.count;
    optim::ParamArrays accum_view;  // the accumulator read as a grad
    accum_view.grad_dtype = DType::kF32;
    accum_view.count = p.arrays.count;
    auto scale = [&](float m) {
      if (m == 1.f) return;
      for (std::size_t i = b; i < e; ++i) p.accum_data[i] *= m;
    };
    switch (job.kind) {
      case JobKind::kLand:
        if (job.add[slot] != 0) {
          accum_view.grad = p.accum_data;
          grad_view.grad_accum = p.accum_data;
          scale(job.mult[slot]);
          kernels_->accumulate(grad_view, b, e, false);
          sums[k] = kernels_->sum_squares(accum_view, b, e);
        } else {
          sums[k] = kernels_->sum_squares(grad_view, b, e);
        }
        break;
      case JobKind::kStash:
        if (job.add[slot] != 0) {
          accum_view.grad = p.accum_data;
          grad_view.grad_accum = p.accum_data;
          kernels_->accumulate(grad_view, b, e, true);
          scale(job.mult[slot]);
          sums[k] = kernels_->sum_squares(accum_view, b, e);
        }
        break;
      case JobKind::kUpdate: {
        const UpdateSource& src = job.sources[slot];
        if (src.skip) break;
        optim::ParamArrays a = subarray(update_arrays(p), b, e);
        a.grad_accum = nullptr;
        thread_local std::vector<float> zeros;
        if (src.grad == nullptr) {
          if (zeros.size() < e - b) zeros.assign(e - b, 0.f);
          a.grad = zeros.data();
          a.grad_dtype = DType::kF32;
        } else {
          a.grad = static_cast<const unsigned char*>(src.grad) + b * dtype_size(src.dtype);
          a.grad_dtype = src.dtype;
        }
        if (config_.kind == OptimizerKind::kAdamW) {
          kernels_->adamw(src.adamw, a, 0, e - b);
        } else {
          kernels_->sgd(src.sgd, a, 0, e - b);
        }
        break;
      }
      default:
        break;
    }
  });
  for (std::size_t k = 0; k < tasks.size(); ++k) {
    job.sums.resize(std::max(job.sums.size(), params_[tasks[k].param].in_layer + 1), 0.0);
    job.sums[params_[tasks[k].param].in_layer] += sums[k];
  }
}

Status Optimizer::step_explicit() {
  std::unique_lock lock(mutex_);
  if (!failure_.is_ok()) return failure_;
  if (in_executor_step_) {
    return error(Code::kInvalidState,
                 "step inside an executor step: call it after strata_step_end (the backward "
                 "pass's grads are not all in yet)");
  }
  ++counters_.step;
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    if (layer_params_[l].empty()) continue;
    Job job;
    job.kind = JobKind::kUpdate;
    job.layer = static_cast<int>(l);
    bool any = false;
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      UpdateSource src;
      if (p.hold != GradHold::kNone) {
        src.skip = false;
        ++p.t;
        if (p.hold == GradHold::kGrad) {
          src.grad = p.arrays.grad;
          src.dtype = p.arrays.grad_dtype;
        } else if (p.hold == GradHold::kAccum) {
          src.grad = p.accum_data;
          src.dtype = DType::kF32;
        }
        const float grad_scale = p.grad_mult / counters_.loss_scale;
        const GroupHyperparams& g = groups_[p.group];
        src.adamw = adamw_scalars(config_, g, static_cast<double>(p.t), grad_scale);
        src.sgd = sgd_scalars(config_, g, p.t, grad_scale);
        any = true;
      }
      job.sources.push_back(src);
    }
    if (!any) continue;
    ++pending_[l];
    queue_.push_back(std::move(job));
  }
  lock.unlock();
  cv_.notify_all();
  return Status::ok();
}

Status Optimizer::step() {
  // One manual step at a time (the header promises it; the pool runs one job at a time). No
  // dispatcher job runs while unattached, so the pool is this step's alone.
  std::lock_guard serial(step_mutex_);
  std::unique_lock lock(mutex_);
  if (executor_ != nullptr && config_.explicit_updates) {
    lock.unlock();
    return step_explicit();
  }
  if (executor_ != nullptr) {
    return error(Code::kInvalidState,
                 "step: the optimizer is attached to an executor, whose steps run its updates");
  }
  if (!failure_.is_ok()) return failure_;
  if (params_.empty()) return error(Code::kInvalidState, "step: the optimizer has no params");
  if (nvme_state_params_ != 0) {
    return error(Code::kInvalidState, "step: ", nvme_state_params_,
                 " params have their state on NVMe, which is staged through DRAM layer by "
                 "layer: only an optimizer attached to an executor updates them");
  }
  if (all_tasks_params_ != params_.size()) {
    std::vector<std::size_t> all(params_.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    all_tasks_ = tasks_for(all);
    all_tasks_params_ = params_.size();
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (micro_ + 1 < config_.accumulation_steps) {
    const bool first = micro_ == 0;
    ++micro_;
    lock.unlock();
    run_tasks(all_tasks_, JobKind::kAccumulate, nullptr, first);
    lock.lock();
    update_seconds_ += seconds_since(t0);
    return Status::ok();
  }
  micro_ = 0;
  StepScalars s;
  s.t = counters_.step + 1;
  s.grad_scale = 1.f / counters_.loss_scale;
  s.groups = groups_;
  if (deferred()) {
    lock.unlock();
    const double total = run_tasks(all_tasks_, JobKind::kNorm, nullptr, false);
    lock.lock();
    finish_norms(total, &s);
  } else {
    counters_.step = s.t;
  }
  if (!s.skip) {
    lock.unlock();
    run_tasks(all_tasks_, JobKind::kUpdate, &s, false);
    lock.lock();
  }
  update_seconds_ += seconds_since(t0);
  return Status::ok();
}

Status Optimizer::quiesce_for_checkpoint(OptimizerCounters* counters) {
  STRATA_RETURN_IF_ERROR(synchronize());
  std::lock_guard lock(mutex_);
  if (config_.explicit_updates && in_executor_step_) {
    return error(Code::kInvalidState,
                 "checkpoint inside an executor step: save or load between steps");
  }
  if (micro_ != 0 || (executor_ != nullptr && grads_in_ != 0 && grads_in_ < layers_with_params_)) {
    return error(Code::kInvalidState, "checkpoint in the middle of an optimizer step (", micro_,
                 " of ", config_.accumulation_steps,
                 " accumulation steps done): save or load after the step's last micro-step");
  }
  *counters = counters_;
  return Status::ok();
}

Status Optimizer::restore_counters(const OptimizerCounters& counters,
                                   const std::vector<uint64_t>& param_steps) {
  std::lock_guard lock(mutex_);
  counters_ = counters;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    params_[i].t = i < param_steps.size() ? param_steps[i] : counters.step;
  }
  micro_ = 0;
  failure_ = Status::ok();
  // A failure may have left staged layers behind (the checkpoint's caller synchronized, so no
  // transfer is in flight): every layer's state is on NVMe again, every slot free.
  if (io_in_flight_ == 0) {
    for (LayerStage& st : stages_) {
      st.phase = StagePhase::kIdle;
      st.slot = -1;
      st.outstanding = 0;
      st.status = Status::ok();
    }
    std::fill(slot_free_.begin(), slot_free_.end(), uint8_t{1});
  }
  return Status::ok();
}

void Optimizer::invalidate(Status why) {
  {
    std::lock_guard lock(mutex_);
    failure_ = std::move(why);
  }
  cv_.notify_all();
}

OptimizerStats Optimizer::stats() {
  std::unique_lock lock(mutex_);
  wait_for_norms(lock);
  OptimizerStats s;
  s.step = counters_.step;
  s.skipped_steps = counters_.skipped_steps;
  s.micro_step = micro_;
  s.last_grad_norm = last_norm_;
  s.loss_scale = counters_.loss_scale;
  s.params = params_.size();
  for (const Param& p : params_) s.elements += p.arrays.count;
  s.state_bytes = state_bytes_;
  s.update_seconds = update_seconds_;
  s.threads = pool_->size();
  s.isa = std::string(optim::isa_name(kernels_->isa));
  s.binding = pool_->binding();
  s.nvme_state_bytes = nvme_state_bytes_;
  s.nvme_state_params = nvme_state_params_;
  s.nvme_state_layers = nvme_layers_;
  s.staging_bytes = staging_bytes_;
  s.staging_slots = static_cast<uint32_t>(slot_free_.size());
  s.state_bytes += staging_bytes_;
  s.nvme_read_bytes = nvme_read_bytes_;
  s.nvme_write_bytes = nvme_write_bytes_;
  s.stage_wait_seconds = stage_wait_seconds_;
  return s;
}

}  // namespace strata
