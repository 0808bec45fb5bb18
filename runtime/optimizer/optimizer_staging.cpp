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

Status Optimizer::layout_stages() {
  free_staging();
  stages_.assign(layer_params_.size(), LayerStage{});
  nvme_layers_ = 0;
  if (nvme_state_params_ == 0 && nvme_weight_params_ == 0) return Status::ok();
  uint64_t largest = 0;
  std::size_t largest_layer = 0;
  for (std::size_t l = 0; l < layer_params_.size(); ++l) {
    LayerStage& st = stages_[l];
    for (std::size_t i : layer_params_[l]) {
      Param& p = params_[i];
      // The weight is staged whole, not only written: a param the update leaves alone (no
      // grad in explicit mode) is written back as it was read, its 4 KiB-rounded tail too.
      const TensorId none = 0;
      const TensorId ids[4] = {p.nvme_state && p.master != p.weight ? p.master : none,
                               p.nvme_state ? p.exp_avg : none, p.nvme_state ? p.exp_avg_sq : none,
                               p.nvme_weight ? p.weight : none};
      st.holds_weights = st.holds_weights || p.nvme_weight;
      for (int k = 0; k < 4; ++k) {
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
  // nvme_staging_bytes also covers the HBM-homed grads' fetch buffer, laid out before this.
  if (config_.nvme_staging_bytes != 0) {
    room = std::min(
        room, config_.nvme_staging_bytes - std::min(config_.nvme_staging_bytes, grad_fetch_bytes_));
  }
  const std::size_t slots = static_cast<std::size_t>(
      std::min<uint64_t>({room / largest, kMaxStagingSlots, nvme_layers_}));
  if (slots == 0) {
    return error(Code::kOutOfMemory, "optimizer: layer ", largest_layer, "'s state on NVMe (",
                 largest, " bytes) must be staged in DRAM for its update, and ", room,
                 " bytes are free for staging (largest free DRAM block ", dram.largest_free,
                 ", nvme_staging_bytes ", config_.nvme_staging_bytes,
                 "): raise the DRAM budget or nvme_staging_bytes");
  }
  Status s = make_buffer("nvme_staging", slots * largest, "optimizer staging", &staging_id_,
                         &staging_base_);
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
      params_[t.param].staged[static_cast<std::size_t>(t.kind)] = base + t.offset;
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

std::vector<Optimizer::StageIo> Optimizer::finish_stage(std::size_t layer, bool dirty,
                                                        bool* wrote) {
  LayerStage& st = stages_[layer];
  std::vector<StageIo> ios;
  st.ahead = false;
  st.round = ahead_round_;  // updated this round: not read ahead again in it
  *wrote = false;
  // Also while stopping: the destructor drains the queue and then waits for every transfer,
  // and an update whose write-back were dropped would be lost (NVMe-homed weights one step
  // behind after strata_optimizer_destroy, which promises to finish queued updates).
  if (dirty && st.status.is_ok()) {
    *wrote = true;
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
