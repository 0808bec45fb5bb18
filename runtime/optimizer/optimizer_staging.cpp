// Optimizer state (and weights) homed on NVMe, staged through DRAM slots layer by layer: layout,
// read-ahead, transfers and write-back (docs/optimizer.md).
#include "runtime/optimizer/optimizer.h"

#include <algorithm>

#include "runtime/nvme/nvme_tier.h"

namespace strata {

namespace {
// Staging slots: at most this many layers' NVMe-homed state in DRAM at once. Past a few, more
// read-ahead does not help: the disk is the bottleneck, and DRAM is better spent on state.
constexpr std::size_t kMaxStagingSlots = 4;
}  // namespace

Status Optimizer::layout_stages(uint64_t room, std::size_t max_slots) {
  free_staging();
  stages_.assign(layer_params_.size(), LayerStage{});
  nvme_layers_ = 0;
  if (nvme_state_params_ == 0 && nvme_weight_params_ == 0 && accum_nvme_bytes_ == 0) {
    return Status::ok();
  }
  uint64_t largest = 0;
  std::size_t largest_layer = 0;
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    LayerStage& st = stages_[l];
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      // The weight is staged whole, not only written: a param the update leaves alone (no
      // grad in explicit mode) is written back as it was read, its 4 KiB-rounded tail too.
      const TensorId none = 0;
      const TensorId ids[5] = {p.nvme_state && p.master != p.weight ? p.master : none,
                               p.nvme_state ? p.exp_avg : none, p.nvme_state ? p.exp_avg_sq : none,
                               p.nvme_weight ? p.weight : none, p.nvme_accum ? p.accum : none};
      st.holds_weights = st.holds_weights || p.nvme_weight;
      for (int k = 0; k < 5; ++k) {
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
        st.classes |= stage_class(k);
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
  if (room == 0) {
    room = dram.largest_free;
    // nvme_staging_bytes also covers the HBM-homed grads' fetch buffer, laid out before this.
    // (Not once accumulators are on NVMe: plan_accumulators chose their slots' room itself.)
    if (config_.nvme_staging_bytes != 0 && accum_nvme_bytes_ == 0) {
      room = std::min(room, config_.nvme_staging_bytes -
                                std::min(config_.nvme_staging_bytes, grad_fetch_bytes_));
    }
  }
  room = std::min(room, dram.largest_free);
  const std::size_t slots = static_cast<std::size_t>(std::min<uint64_t>(
      {room / largest, max_slots != 0 ? max_slots : kMaxStagingSlots, nvme_layers_}));
  if (slots == 0) {
    return error(Code::kOutOfMemory, "optimizer: layer ", largest_layer, "'s state on NVMe (",
                 largest, " bytes) must be staged in DRAM for its update, and ", room,
                 " bytes are free for staging (largest free DRAM block ", dram.largest_free,
                 ", nvme_staging_bytes ", config_.nvme_staging_bytes,
                 "): raise the DRAM budget or nvme_staging_bytes");
  }
  Status s = make_buffer("nvme_staging", slots * largest, "optimizer staging",
                         Role::kOptimizerState, &staging_id_, &staging_base_);
  if (!s.is_ok()) {
    return error(s.code(), "optimizer: staging for NVMe-homed state (", slots, " x ", largest,
                 " bytes): ", s.message());
  }
  slot_bytes_ = largest;
  slot_free_.assign(slots, 1);
  staging_bytes_ = slots * largest;
  return Status::ok();
}

void Optimizer::free_staging() {
  drop_buffer(&staging_id_);
  staging_base_ = nullptr;
  slot_bytes_ = 0;
  slot_free_.clear();
  staging_bytes_ = 0;
}

uint8_t Optimizer::stage_need(const Job& job) const {
  if (job.layer < 0) return 0;
  const auto l = static_cast<std::size_t>(job.layer);
  if (l >= stages_.size() || stages_[l].tensors.empty()) return 0;
  const LayerStage& st = stages_[l];
  uint8_t need = 0;
  switch (job.kind) {
    case JobKind::kUpdate:
      need = st.classes & kStateClass;
      for (const UpdateSource& src : job.sources) {
        if (!src.skip && src.staged_accum) need |= kAccumClass;
      }
      break;
    case JobKind::kLand:
    case JobKind::kStash:
      // A landing that adds, or a stash that moves, into an NVMe-homed accumulator. (A stash
      // overwrites it, but its layer's other accumulators in the slot are written back with
      // it: the slot reads them all.)
      for (std::size_t k = 0; k < job.add.size(); ++k) {
        if (job.add[k] != 0 && params_[layer_params_[l][k]].nvme_accum) need |= kAccumClass;
      }
      break;
    default:
      break;
  }
  return need;
}

bool Optimizer::stage_ready(const Job& job) const {
  // After a failure nothing is staged any more: the job runs to report it.
  const uint8_t need = stage_need(job);
  if (need == 0 || !failure_.is_ok()) return true;
  const LayerStage& st = stages_[static_cast<std::size_t>(job.layer)];
  return st.phase == StagePhase::kStaged && (st.loaded & need) == need;
}

void Optimizer::release_slot(std::size_t layer) {
  LayerStage& st = stages_[layer];
  if (st.slot >= 0) slot_free_[static_cast<std::size_t>(st.slot)] = 1;
  st.slot = -1;
  st.phase = StagePhase::kIdle;
  st.ahead = false;
  st.loaded = st.incoming = 0;
  st.in_use = false;
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
    if (st.phase != StagePhase::kStaged || !st.ahead || st.in_use || !st.status.is_ok()) continue;
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
  // The layers whose first queued job needs their slot, lowest first (the order pick_job runs
  // them in), with what that job needs of it (a layer's jobs run in queue order).
  std::vector<std::size_t> queued;
  std::vector<uint8_t> queued_need(stages_.size(), 0);
  for (const Job& j : queue_) {
    const uint8_t need = stage_need(j);
    if (need == 0) continue;
    const auto l = static_cast<std::size_t>(j.layer);
    if (std::find(queued.begin(), queued.end(), l) == queued.end()) {
      queued.push_back(l);
      queued_need[l] = need;
    }
  }
  std::sort(queued.begin(), queued.end());
  std::vector<std::size_t> want;
  for (std::size_t l : queued) {
    const LayerStage& st = stages_[l];
    // Idle, or staged (read ahead, or for an earlier job) without all the job needs: a job
    // running on the slot keeps it as it is.
    if (st.phase == StagePhase::kIdle || (st.phase == StagePhase::kStaged && !st.in_use &&
                                          (st.loaded & queued_need[l]) != queued_need[l])) {
      want.push_back(l);
    }
  }
  std::size_t needed = want.size();
  if (ahead_round_ != 0) {
    // Then, with the slots left, the layers the updates of this step will need, read during
    // its backward pass (each once per step): their state, not their accumulators (which
    // this step's landings still change).
    for (std::size_t k = 0; k < stages_.size(); ++k) {
      const std::size_t l = ahead_descending_ ? stages_.size() - 1 - k : k;
      const LayerStage& st = stages_[l];
      if ((st.classes & kStateClass) == 0 || st.phase != StagePhase::kIdle ||
          st.round == ahead_round_ || std::find(want.begin(), want.end(), l) != want.end()) {
        continue;
      }
      want.push_back(l);
    }
  }
  for (std::size_t i = 0; i < want.size(); ++i) {
    const std::size_t l = want[i];
    const bool ahead = i >= needed;
    LayerStage& st = stages_[l];
    const uint8_t need = ahead ? kStateClass : queued_need[l];
    if (st.phase == StagePhase::kIdle) {
      // Reading ahead takes only a free slot; a queued job may take one back.
      const int slot = ahead ? free_slot() : take_slot(queued);
      if (slot < 0) {
        if (ahead) break;
        continue;
      }
      slot_free_[static_cast<std::size_t>(slot)] = 0;
      st.slot = slot;
      st.status = Status::ok();
      st.ahead = ahead;
      if (ahead) st.round = ahead_round_;
      unsigned char* base = staging_base_ + static_cast<uint64_t>(st.slot) * slot_bytes_;
      for (const StagedTensor& t : st.tensors) {
        params_[t.param].staged[static_cast<std::size_t>(t.kind)] = base + t.offset;
      }
    }
    // The classes the slot lacks, read into their places (the others stay as they are).
    st.incoming = need & ~st.loaded;
    st.phase = StagePhase::kReading;
    st.outstanding = 0;
    for (std::size_t k = 0; k < st.tensors.size(); ++k) {
      if ((stage_class(st.tensors[k].kind) & st.incoming) == 0) continue;
      ios.push_back(StageIo{false, static_cast<uint32_t>(l), k});
      ++st.outstanding;
    }
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
      st.status = error(s.code(), "optimizer: ", io.write ? "writing" : "reading", " the ",
                        t.kind == 3 ? "weight" : "state", " '", t.name, "' of layer ", io.layer,
                        io.write ? " to" : " from", " NVMe: ", s.message());
      fail(st.status);
    }
    if (--st.outstanding == 0) {
      if (io.write) {
        // Written back: the slot is free for the next layer, and a layer whose weights were
        // in it may be loaded again (a failed write fails the optimizer, which stops loads).
        if (st.pending_held) {
          st.pending_held = false;
          --pending_[io.layer];
        }
        release_slot(io.layer);
        more = stage_more();
      } else {
        // Read in (or failed: the job then runs no kernels and finish_stage frees the slot).
        st.phase = StagePhase::kStaged;
        st.loaded |= st.incoming;
        st.incoming = 0;
      }
    }
    // Under the lock: once io_in_flight_ is 0 the destructor may run, and this thread must
    // not touch cv_ after that (start_io below runs only with transfers counted in flight).
    cv_.notify_all();
  }
  start_io(more);
}

std::vector<Optimizer::StageIo> Optimizer::finish_stage(std::size_t layer, uint8_t dirty,
                                                        bool update, bool* wrote) {
  LayerStage& st = stages_[layer];
  std::vector<StageIo> ios;
  st.ahead = false;
  st.in_use = false;
  // Updated this round: not read ahead again in it (a landing leaves the state as it was).
  if (update) st.round = ahead_round_;
  *wrote = false;
  // Also while stopping: the destructor drains the queue and then waits for every transfer,
  // and an update whose write-back were dropped would be lost (NVMe-homed weights one step
  // behind after strata_optimizer_destroy, which promises to finish queued updates). Only
  // what the job changed goes back: the update's state and weights, or a landing's sums.
  dirty &= st.loaded;
  if (dirty != 0 && st.status.is_ok() && st.phase == StagePhase::kStaged) {
    *wrote = true;
    st.phase = StagePhase::kWriting;
    st.outstanding = 0;
    for (std::size_t k = 0; k < st.tensors.size(); ++k) {
      if ((stage_class(st.tensors[k].kind) & dirty) == 0) continue;
      ios.push_back(StageIo{true, static_cast<uint32_t>(layer), k});
      ++st.outstanding;
    }
    io_in_flight_ += st.outstanding;
    return ios;
  }
  // Unchanged (a skipped step) or failed: nothing to write back. A layer whose reads are
  // still in flight (the optimizer failed meanwhile) keeps its slot until they end.
  if (st.phase == StagePhase::kReading || st.phase == StagePhase::kWriting) return ios;
  release_slot(layer);
  return stage_more();
}

std::vector<Optimizer::StageIo> Optimizer::read_ahead(bool descending) {
  if (nvme_layers_ == 0) return {};
  ahead_round_ = ++rounds_;
  ahead_descending_ = descending;
  return stage_more();
}

optim::ParamArrays Optimizer::update_arrays(const Param& p) const {
  optim::ParamArrays a = p.arrays;
  const auto f32 = [&](int kind) { return static_cast<float*>(p.staged[kind]); };
  if (p.nvme_state) {
    if (p.split) {
      a.master_low = static_cast<int16_t*>(p.staged[0]);
    } else if (p.master != p.weight) {
      a.master = f32(0);
    }
    if (p.exp_avg != 0) a.exp_avg = f32(1);
    if (p.exp_avg_sq != 0) a.exp_avg_sq = f32(2);
  }
  if (p.nvme_weight) {
    if (p.master == p.weight) {
      a.master = f32(3);  // an fp32 weight is its own master
    } else {
      a.weight = p.staged[3];
    }
  }
  return a;
}

}  // namespace strata
