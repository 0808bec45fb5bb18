// The optimizer's lifecycle: configuration checks, creation (thread pool, kernels, dispatcher),
// attaching to an executor, failure, statistics. Each other job has its own optimizer_*.cpp.
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <cmath>

#include "common/spawn.h"
#include "runtime/optimizer/optimizer_internal.h"
#include "runtime/stream/executor.h"

namespace strata {

Status check_finite(const char* what, float v, float lo, bool lo_inclusive) {
  if (!std::isfinite(v) || v < lo || (!lo_inclusive && v == lo)) {
    return error(Code::kInvalidArgument, "optimizer config: ", what, " is ", v, ", must be ",
                 lo_inclusive ? ">= " : "> ", lo);
  }
  return Status::ok();
}

Status check_betas(float beta1, float beta2, float eps) {
  for (auto [name, b] : {std::pair{"beta1", beta1}, std::pair{"beta2", beta2}}) {
    if (!(b >= 0.f && b < 1.f)) {
      return error(Code::kInvalidArgument, "optimizer config: ", name, " is ", b,
                   ", must be in [0, 1)");
    }
  }
  return check_finite("eps", eps, 0.f, false);
}

bool known_kind(int32_t kind) {
  return kind >= static_cast<int32_t>(OptimizerKind::kAdamW) &&
         kind <= static_cast<int32_t>(OptimizerKind::kAdagrad);
}

const char* kind_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kLion:
      return "lion";
    case OptimizerKind::kAdagrad:
      return "adagrad";
  }
  return "unknown";
}

StateSet state_set(OptimizerKind kind, float momentum) {
  switch (kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      return {".exp_avg", ".exp_avg_sq"};
    case OptimizerKind::kSgd:
      return {momentum > 0.f ? ".momentum_buffer" : nullptr, nullptr};
    case OptimizerKind::kLion:
      return {".exp_avg", nullptr};
    case OptimizerKind::kAdagrad:
      return {nullptr, ".sum"};
  }
  return {};
}

namespace {
Status validate(const OptimizerConfig& c) {
  if (!known_kind(static_cast<int32_t>(c.kind))) {
    return error(Code::kInvalidArgument, "optimizer config: unknown kind ",
                 static_cast<int>(c.kind));
  }
  STRATA_RETURN_IF_ERROR(check_finite("lr", c.lr, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("weight_decay", c.weight_decay, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("max_grad_norm", c.max_grad_norm, 0.f, true));
  STRATA_RETURN_IF_ERROR(check_finite("loss_scale", c.loss_scale, 0.f, false));
  if (c.kind != OptimizerKind::kSgd) {
    // Lion has no eps and Adagrad no betas, but a group's are checked whatever the kind
    // (set_group_hyperparams), and the config is group 0's.
    STRATA_RETURN_IF_ERROR(check_betas(c.beta1, c.beta2, c.eps));
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
  o->groups_.push_back(GroupHyperparams{o->config_.lr, o->config_.weight_decay, o->config_.beta1,
                                        o->config_.beta2, o->config_.eps});
  o->counters_.loss_scale = o->config_.loss_scale;
  STRATA_RETURN_IF_ERROR(spawn_thread(
      "the optimizer's dispatcher", [p = o.get()] { p->dispatcher_main(); }, &o->dispatcher_));
  // A checkpoint of the runtime waits for the updates running (a failed optimizer's error is
  // its own calls' to report).
  o->runtime_->add_background_writer(o.get(), [p = o.get()] { (void)p->synchronize(); });
  *out = std::move(o);
  return Status::ok();
}

Optimizer::~Optimizer() {
  runtime_->remove_background_writer(this);  // waits for a checkpoint's wait on this one
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
  free_grad_fetch();
  unregister_state();
}

Status Optimizer::attach(Executor* executor) {
  std::vector<std::vector<std::size_t>> layer_params;
  {
    std::unique_lock lock(mutex_);
    if (executor_ != nullptr) return error(Code::kBusy, "the optimizer is already attached");
    // A failed optimizer's queued jobs belong to the old layout (its pending counts, tasks and
    // fetch buffer, all laid out again below): dropped, as a load drops them.
    if (!failure_.is_ok()) drop_failed_step(lock);
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
    backward_.assign(plan.layer_count, Backward::kIdle);
    aborted_adds_.assign(plan.layer_count, nullptr);
    grads_in_ = 0;
    // The grads' fetch buffer first: a PLANNED state placement kept nvme_staging_bytes free
    // for both, and the staging takes what is left of it.
    STRATA_RETURN_IF_ERROR(layout_grad_fetch());
    Status staged = layout_stages();
    if (!staged.is_ok()) {
      free_grad_fetch();
      return staged;
    }
    executor_ = executor;
  }
  // Outside mutex_: the executor calls the hooks under its own lock, so it is always taken first.
  Status s = executor->attach_hooks(shared_from_this());
  if (!s.is_ok()) {
    std::lock_guard lock(mutex_);
    executor_ = nullptr;
    free_staging();
    free_grad_fetch();
  }
  return s;
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
  s.state_bytes += staging_bytes_ + grad_fetch_bytes_;
  s.nvme_read_bytes = nvme_read_bytes_;
  s.nvme_write_bytes = nvme_write_bytes_;
  s.stage_wait_seconds = stage_wait_seconds_;
  return s;
}

}  // namespace strata
