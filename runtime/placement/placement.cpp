#include "runtime/placement/placement.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <queue>
#include <sstream>

#include "common/json.h"

namespace strata {
namespace {

// ---- A list scheduler: tasks on single-server resources, started in time order ----------------
//
// Each task runs on one resource for a fixed time once its dependencies have ended. A resource
// serves, whenever it is free, the ready task with the lowest priority value (the order the
// runtime issues work in); idle, the first task to become ready. Picking the task with the earliest
// possible start over all resources keeps time moving forward, so a request issued later never
// overtakes one issued earlier.

enum Resource : int { kCompute, kH2d, kD2h, kDisk, kCpu, kResources };

struct Task {
  int resource = kCompute;
  double duration = 0;
  long priority = 0;
  std::vector<int> dependents;
  int unmet = 0;
  double ready = 0, start = -1, end = -1;
};

class Schedule {
 public:
  int add(int resource, double duration, long priority, std::initializer_list<int> deps) {
    const int id = static_cast<int>(tasks_.size());
    Task t;
    t.resource = resource;
    t.duration = std::max(0.0, duration);
    t.priority = priority;
    tasks_.push_back(std::move(t));
    for (int d : deps) depend(id, d);
    return id;
  }
  // `task` starts only after `on` ends (-1: nothing).
  void depend(int task, int on) {
    if (on < 0) return;
    tasks_[static_cast<std::size_t>(on)].dependents.push_back(task);
    ++tasks_[static_cast<std::size_t>(task)].unmet;
  }
  void run() {
    // Per resource: tasks whose dependencies ended, by the time they became ready (pending),
    // and those ready by the time the resource is free, by priority (available). A resource
    // serves the best available task when it is free, else, idle, the best of those ready
    // when the first pending one is.
    // O(tasks log tasks): a placement of hundreds of layers simulates hundreds of times.
    using Entry = std::pair<double, long>;  // (ready or priority, task)
    using MinHeap = std::priority_queue<Entry, std::vector<Entry>, std::greater<>>;
    std::vector<MinHeap> pending(kResources), available(kResources);
    double free_at[kResources] = {};
    auto make_ready = [&](int id) {
      const Task& t = task(id);
      pending[static_cast<std::size_t>(t.resource)].emplace(t.ready, id);
    };
    for (std::size_t i = 0; i < tasks_.size(); ++i) {
      if (tasks_[i].unmet == 0) make_ready(static_cast<int>(i));
    }
    // Moves `r`'s pending tasks ready by `time` to its available ones.
    auto release = [&](int r, double time) {
      auto& p = pending[static_cast<std::size_t>(r)];
      while (!p.empty() && p.top().first <= time) {
        const long id = p.top().second;
        p.pop();
        available[static_cast<std::size_t>(r)].emplace(task(static_cast<int>(id)).priority, id);
      }
    };
    for (std::size_t done = 0; done < tasks_.size(); ++done) {
      int best_r = -1;
      double best_start = std::numeric_limits<double>::infinity();
      long best_priority = 0;
      for (int r = 0; r < kResources; ++r) {
        release(r, free_at[r]);
        auto& a = available[static_cast<std::size_t>(r)];
        auto& p = pending[static_cast<std::size_t>(r)];
        double start = free_at[r];
        long priority = 0;
        if (!a.empty()) {
          priority = a.top().first;
        } else if (!p.empty()) {  // idle until its first pending task is ready
          start = p.top().first;
          priority = task(static_cast<int>(p.top().second)).priority;
        } else {
          continue;
        }
        if (start < best_start || (start == best_start && priority < best_priority)) {
          best_start = start;
          best_r = r;
          best_priority = priority;
        }
      }
      if (best_r < 0) return;  // a cycle: cannot happen with the graphs built below
      release(best_r, best_start);
      auto& a = available[static_cast<std::size_t>(best_r)];
      const int id = static_cast<int>(a.top().second);
      a.pop();
      Task& t = tasks_[static_cast<std::size_t>(id)];
      t.start = best_start;
      t.end = best_start + t.duration;
      free_at[best_r] = t.end;
      busy_[best_r] += t.duration;
      for (int d : t.dependents) {
        Task& u = tasks_[static_cast<std::size_t>(d)];
        u.ready = std::max(u.ready, t.end);
        if (--u.unmet == 0) make_ready(d);
      }
    }
  }
  const Task& task(int id) const { return tasks_[static_cast<std::size_t>(id)]; }
  double end(int id) const { return id < 0 ? 0 : task(id).end; }
  double busy(int r) const { return busy_[r]; }

 private:
  std::vector<Task> tasks_;
  double busy_[kResources] = {};
};

double seconds(uint64_t bytes, double rate, double factor = 1) {
  return rate > 0 ? static_cast<double>(bytes) / rate * factor : 0;
}

// Whether a layer's update stages through DRAM (a trainable layer with state or weights on
// NVMe), and what it stages and writes back: its NVMe-homed state and weights.
uint64_t staged_bytes(const PlacementLayer& l, const LayerHome& h) {
  return (h.state_on_nvme ? l.state_bytes - std::min(l.state_bytes, h.state_in_dram) : 0) +
         (h.weights_on_nvme ? l.weight_bytes : 0);
}
bool staged(const PlacementLayer& l, const LayerHome& h) {
  return l.state_bytes > 0 && staged_bytes(l, h) > 0;
}

// Steps simulated: the first fills the pipeline, the period is measured over the rest.
constexpr int kSteps = 4;

}  // namespace

StepPrediction predict_step(const PlacementRequest& request, const std::vector<LayerHome>& homes,
                            uint32_t slots) {
  const auto& layers = request.layers;
  const std::size_t n = layers.size();
  const PlacementRates& rate = request.rates;
  const double mixed = rate.nvme_mixed > 0 ? rate.nvme_mixed : 1;
  const std::size_t depth = std::max<std::size_t>(1, request.prefetch_depth);
  Schedule sched;
  double disk_read = 0, disk_write = 0;
  auto read = [&](uint64_t bytes, long priority, std::initializer_list<int> deps) {
    const double t = seconds(bytes, rate.nvme_read, mixed);
    disk_read += t;
    return sched.add(kDisk, t, priority, deps);
  };
  // Per layer: the task whose end lets the next step load it (its update, or the write-back of
  // an NVMe-homed weight), and the write-back of its staged state.
  std::vector<int> weights_current(n, -1), written_back(n, -1);
  // The staging sequence over all steps: each read's task and the write-back that frees its
  // slot; read q takes the slot write-back q - slots gives back.
  std::vector<int> stage_reads, stage_writes;
  std::vector<int> position_compute, position_out;  // the executor's sequence, all steps
  std::vector<int> step_end(kSteps, -1);
  std::vector<std::vector<int>> updates(kSteps);  // each step's update tasks
  int previous_compute = -1, previous_backward_end = -1, previous_first = -1;
  long seq = 0;  // priorities: the order things are issued in
  for (int s = 0; s < kSteps; ++s) {
    // The optimizer reads ahead the NVMe-homed state of this step's updates from its start
    // (in forward order, the order its updates run).
    std::vector<int> reads(n, -1);  // each staged layer's read
    std::vector<std::size_t> stage_index(n, 0);
    for (std::size_t i = 0; i < n; ++i) {
      if (!staged(layers[i], homes[i])) continue;
      reads[i] =
          read(staged_bytes(layers[i], homes[i]), seq++, {previous_backward_end, written_back[i]});
      stage_index[i] = stage_reads.size();
      stage_reads.push_back(reads[i]);
      stage_writes.push_back(-1);
    }
    // The executor: forward 0..n-1, the rest of the model, backward n-1..0.
    std::vector<int> grads_out(n, -1);
    auto position = [&](std::size_t i, bool backward) {
      const std::size_t p = position_compute.size();
      const PlacementLayer& l = layers[i];
      const double h2d = seconds(l.weight_bytes, rate.h2d);
      // The forward pass loads a layer once its last update is in (an NVMe-homed weight: once
      // written back); the backward pass loads the same values again.
      const int current = backward ? -1 : weights_current[i];
      // The executor issues its loads in order: one waits for the one before it to start
      // its first leg (approximated: to end it).
      int first, load;
      if (homes[i].weights_on_nvme) {  // disk -> staging -> HBM
        first = read(l.weight_bytes, seq++, {current, previous_first});
        load = sched.add(kH2d, h2d, seq++, {first});
      } else {
        first = load = sched.add(kH2d, h2d, seq++, {current, previous_first});
      }
      previous_first = first;
      // Its HBM slot is the one `depth + 1` positions back: free once that one computed and
      // sent its grads out.
      if (p >= depth + 1) {
        sched.depend(first, position_compute[p - depth - 1]);
        sched.depend(first, position_out[p - depth - 1]);
      }
      const int compute = sched.add(kCompute, backward ? l.backward_seconds : l.forward_seconds,
                                    seq++, {load, previous_compute});
      previous_compute = compute;
      int out = -1;
      if (backward) {
        // Grads in DRAM are sent there, and hold the HBM slot until they are. Grads in HBM are
        // in their homes once computed (the slot holds none); a step that waits for the whole
        // backward pass reads each layer's once during it (the clipping norm, or the explicit
        // step's landing), through the fetch buffer.
        const bool in_hbm = l.grad_tier == kGradsInHbm;
        grads_out[i] = in_hbm && !request.updates_after_backward
                           ? compute
                           : sched.add(kD2h, seconds(l.grad_bytes, rate.d2h), seq++, {compute});
        if (!in_hbm) out = grads_out[i];
      }
      position_compute.push_back(compute);
      position_out.push_back(out);
    };
    for (std::size_t i = 0; i < n; ++i) position(i, false);
    previous_compute = sched.add(kCompute, request.other_device_seconds, seq++, {previous_compute});
    for (std::size_t i = n; i-- > 0;) position(i, true);
    // The end of the backward pass: the last compute done and every grad landed.
    const int backward_end = sched.add(kCompute, 0, seq++, {previous_compute});
    for (std::size_t i = 0; i < n; ++i) sched.depend(backward_end, grads_out[i]);
    step_end[static_cast<std::size_t>(s)] = backward_end;
    // The updates, queued in forward order; when several wait, one holding a staging slot
    // goes first (it frees the slot for the next read). An update of HBM-homed grads copies
    // them into the one fetch buffer as it runs (each part is updated as it lands, so it lasts
    // the longer of the two; the CPU runs one job at a time, so the buffer is its job's alone).
    for (std::size_t i = 0; i < n; ++i) {
      if (layers[i].state_bytes == 0) continue;
      const long base = static_cast<long>(s) * 4 * static_cast<long>(n);
      const long priority =
          base + (reads[i] >= 0 ? 0 : static_cast<long>(n)) + static_cast<long>(i);
      const double cpu = rate.update_elements > 0
                             ? static_cast<double>(layers[i].update_elements) / rate.update_elements
                             : 0;
      const int gate = request.updates_after_backward ? backward_end : grads_out[i];
      const bool fetched = layers[i].grad_tier == kGradsInHbm;
      const double fetch = fetched ? seconds(layers[i].grad_bytes, rate.d2h) : 0;
      const int update = sched.add(kCpu, std::max(cpu, fetch), priority, {gate, reads[i]});
      if (fetched) sched.add(kD2h, fetch, seq++, {gate, reads[i]});  // the link's busy time
      weights_current[i] = update;
      updates[static_cast<std::size_t>(s)].push_back(update);
      if (reads[i] < 0) continue;
      const double t = seconds(staged_bytes(layers[i], homes[i]), rate.nvme_write, mixed);
      disk_write += t;
      const int write = sched.add(kDisk, t, seq++, {update});
      stage_writes[stage_index[i]] = write;
      written_back[i] = write;
      if (homes[i].weights_on_nvme) weights_current[i] = write;
    }
    previous_backward_end = backward_end;
  }
  // Staging slots: read q waits for the write-back that frees the slot it takes.
  if (slots > 0) {
    for (std::size_t q = slots; q < stage_reads.size(); ++q)
      sched.depend(stage_reads[q], stage_writes[q - slots]);
  }
  sched.run();
  StepPrediction p;
  p.step_seconds = (sched.end(step_end[kSteps - 1]) - sched.end(step_end[1])) / (kSteps - 2);
  const double per_step = 1.0 / kSteps;
  p.compute = sched.busy(kCompute) * per_step;
  p.h2d = sched.busy(kH2d) * per_step;
  p.d2h = sched.busy(kD2h) * per_step;
  p.update = sched.busy(kCpu) * per_step;
  p.nvme_read = disk_read * per_step;
  p.nvme_write = disk_write * per_step;
  p.gpu_wait = std::max(0.0, p.step_seconds - p.compute);
  // The CPU idle between a step's backward end and its last update's end: the updates waiting
  // for their state (or, updating as grads land, for grads), over the steady-state steps.
  for (int s = 1; s < kSteps; ++s) {
    double last = 0, busy = 0;
    for (int u : updates[static_cast<std::size_t>(s)]) {
      last = std::max(last, sched.end(u));
      busy += sched.task(u).duration;
    }
    const double span = last - sched.end(step_end[static_cast<std::size_t>(s)]);
    if (!updates[static_cast<std::size_t>(s)].empty())
      p.update_wait += std::max(0.0, span - busy) / (kSteps - 1);
  }
  const std::pair<double, const char*> busy[] = {{p.compute, "compute"},
                                                 {p.h2d, "h2d"},
                                                 {p.d2h, "d2h"},
                                                 {p.nvme_read + p.nvme_write, "nvme"},
                                                 {p.update, "update"}};
  p.bottleneck = std::max_element(std::begin(busy), std::end(busy), [](auto& a, auto& b) {
                   return a.first < b.first;
                 })->second;
  return p;
}

namespace {

struct Footprint {
  uint64_t dram = 0, nvme = 0, slot = 0, fetch = 0;
};

// What `homes` with `slots` staging slots takes of each tier. A slot holds the largest staged
// layer's state and, when its weights are on NVMe too, its weights; HBM-homed grads take one
// buffer in DRAM, the largest such layer's (in `dram` and in `fetch`).
Footprint footprint(const std::vector<PlacementLayer>& layers, const std::vector<LayerHome>& homes,
                    uint32_t slots) {
  Footprint f;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const PlacementLayer& l = layers[i];
    if (l.grad_tier == kGradsInHbm) {
      f.fetch = std::max(f.fetch, l.grad_bytes);
    } else {
      f.dram += l.grad_bytes;
    }
    (homes[i].weights_on_nvme ? f.nvme : f.dram) += l.weight_bytes;
    (homes[i].state_on_nvme ? f.nvme : f.dram) += l.state_bytes;
    if (staged(l, homes[i])) f.slot = std::max(f.slot, staged_bytes(l, homes[i]));
  }
  f.dram += f.fetch + f.slot * slots;
  return f;
}

Status check_tier(int tier, const std::string& layer, const char* role) {
  if (tier == -1 || tier == 1 || tier == 2) return Status::ok();
  return error(Code::kInvalidArgument, "layer '", layer, "': ", role, " tier ", tier,
               " is not -1 (choose), 1 (dram) or 2 (nvme)");
}

std::string layer_name(const PlacementRequest& r, std::size_t i) {
  return r.layers[i].name.empty() ? "layer." + std::to_string(i) : r.layers[i].name;
}

std::string gib(uint64_t bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(2) << static_cast<double>(bytes) / (1ull << 30) << " GiB";
  return o.str();
}

}  // namespace

Status choose_placement(const PlacementRequest& request, Placement* out) {
  const std::size_t n = request.layers.size();
  if (n == 0) return error(Code::kInvalidArgument, "the placement request has no layers");
  if (n > kMaxPlacementLayers) {
    return error(Code::kInvalidArgument, "the placement request has ", n, " layers; at most ",
                 kMaxPlacementLayers, " are simulated");
  }
  if (request.max_staging_slots == 0 || request.max_staging_slots > kMaxStagingSlots ||
      request.staging_slots > request.max_staging_slots) {
    return error(Code::kInvalidArgument, "staging_slots ", request.staging_slots,
                 " must be at most max_staging_slots ", request.max_staging_slots,
                 ", which must be 1..", kMaxStagingSlots, " (what the optimizer stages at once)");
  }
  if (request.prefetch_depth > kMaxPrefetchDepth) {
    return error(Code::kInvalidArgument, "prefetch_depth ", request.prefetch_depth, " is above ",
                 kMaxPrefetchDepth);
  }
  const PlacementRates& r = request.rates;
  for (double v : {r.h2d, r.d2h, r.nvme_read, r.nvme_write, r.nvme_mixed, r.update_elements,
                   request.other_device_seconds}) {
    if (!(v >= 0) || std::isinf(v))
      return error(Code::kInvalidArgument, "placement rates and times must be finite and >= 0");
  }
  // Bounds that keep every simulated time finite (2^44 bytes at 1 B/s, a million tasks).
  for (double v : {r.h2d, r.d2h, r.nvme_read, r.nvme_write, r.update_elements}) {
    if (v > 0 && v < 1) {
      return error(Code::kInvalidArgument, "a placement rate of ", v,
                   " per second is below 1 (0 = not counted)");
    }
  }
  if (request.other_device_seconds > kMaxSeconds) {
    return error(Code::kInvalidArgument, "other_device_seconds ", request.other_device_seconds,
                 " is above ", kMaxSeconds);
  }
  if (r.nvme_mixed > 1 || (r.nvme_mixed > 0 && r.nvme_mixed < 0.5)) {
    return error(Code::kInvalidArgument, "nvme_mixed ", r.nvme_mixed,
                 " is outside [0.5, 1] (0 = 1: reads and writes serialized)");
  }
  // The layers whose homes are chosen, as suffixes: `k` spills the state of the last k
  // choosable layers, `w` the weights of the last w. Fixed homes stay as given.
  std::vector<std::size_t> state_choosable, weight_choosable;
  std::vector<LayerHome> fixed(n);
  for (std::size_t i = 0; i < n; ++i) {
    const PlacementLayer& l = request.layers[i];
    STRATA_RETURN_IF_ERROR(check_tier(l.weight_tier, layer_name(request, i), "weight"));
    STRATA_RETURN_IF_ERROR(check_tier(l.state_tier, layer_name(request, i), "state"));
    if (l.grad_tier != kGradsInHbm && l.grad_tier != kGradsInDram) {
      return error(Code::kInvalidArgument, "layer '", layer_name(request, i), "': grad tier ",
                   l.grad_tier, " is not 0 (hbm) or 1 (dram)");
    }
    for (uint64_t v : {l.weight_bytes, l.grad_bytes, l.state_bytes, l.update_elements}) {
      // Sums over every layer (3 roles x 16384 layers x 2^44) stay below 2^64.
      if (v > kMaxLayerBytes) {
        return error(Code::kInvalidArgument, "layer '", layer_name(request, i), "': a size of ", v,
                     " is above the ", kMaxLayerBytes, " a layer may declare");
      }
    }
    if (!(l.forward_seconds >= 0) || !(l.backward_seconds >= 0) ||
        l.forward_seconds > kMaxSeconds || l.backward_seconds > kMaxSeconds) {
      return error(Code::kInvalidArgument, "layer '", layer_name(request, i),
                   "': forward and backward seconds must be >= 0 and at most ", kMaxSeconds);
    }
    fixed[i].weights_on_nvme = l.weight_tier == 2;
    fixed[i].state_on_nvme = l.state_tier == 2 && l.state_bytes > 0;
    if ((l.weight_tier == 2 || l.state_tier == 2) && request.nvme_budget == 0) {
      return error(Code::kInvalidArgument, "layer '", layer_name(request, i),
                   "' has a home fixed on NVMe, and the NVMe budget is 0");
    }
    if (l.state_tier == -1 && l.state_bytes > 0) state_choosable.push_back(i);
    if (l.weight_tier == -1) weight_choosable.push_back(i);
  }
  const bool nvme = request.nvme_budget > 0;
  const std::size_t max_k = nvme ? state_choosable.size() : 0;
  const std::size_t max_w = nvme ? weight_choosable.size() : 0;
  const uint32_t first_slots = request.staging_slots ? request.staging_slots : 1;
  const uint32_t last_slots =
      request.staging_slots ? request.staging_slots : request.max_staging_slots;

  const auto& L = request.layers;
  std::vector<Placement> fits;
  uint64_t least_dram = std::numeric_limits<uint64_t>::max();
  uint64_t least_nvme = std::numeric_limits<uint64_t>::max();  // of those DRAM holds
  for (uint32_t slots = first_slots; slots <= last_slots; ++slots) {
    // The weights of the last w layers on NVMe, then the least state spilled (the last k
    // layers') that fits DRAM: DRAM first. More weights spilled frees DRAM for state but moves
    // 4 x their bytes a step: past the best w, each step only adds traffic, so the search
    // stops after two candidates in a row no faster than this slot count's best.
    double best_here = std::numeric_limits<double>::infinity();
    int slower = 0;
    for (std::size_t w = 0; w <= max_w && slower < 2; ++w) {
      std::vector<LayerHome> h = fixed;
      for (std::size_t j = weight_choosable.size() - w; j < weight_choosable.size(); ++j)
        h[weight_choosable[j]].weights_on_nvme = true;
      // A layer whose weights spilled is staged with its state: that state spills too (and,
      // state spilling as a suffix, every later layer's).
      std::size_t k = 0;
      for (std::size_t q = 0; q < state_choosable.size(); ++q) {
        if (h[state_choosable[q]].weights_on_nvme) k = std::max(k, state_choosable.size() - q);
      }
      for (std::size_t q = state_choosable.size() - k; q < state_choosable.size(); ++q)
        h[state_choosable[q]].state_on_nvme = true;
      // The footprint without slots, then each further layer's state out, in O(1) each.
      Footprint f = footprint(L, h, 0);
      bool any_staged = false;
      for (std::size_t i = 0; i < n; ++i) any_staged = any_staged || staged(L[i], h[i]);
      auto dram = [&] { return f.dram + (any_staged ? f.slot * slots : 0); };
      while (dram() > request.dram_budget && k < max_k) {
        const std::size_t j = state_choosable[state_choosable.size() - 1 - k];
        h[j].state_on_nvme = true;
        f.dram -= L[j].state_bytes;
        f.nvme += L[j].state_bytes;
        f.slot = std::max(f.slot, staged_bytes(L[j], h[j]));
        any_staged = true;
        ++k;
      }
      least_dram = std::min(least_dram, dram());
      if (dram() > request.dram_budget) continue;  // more weights out may make it fit
      least_nvme = std::min(least_nvme, f.nvme);
      // More weights out may need less state out, and so less NVMe: keep looking.
      if (f.nvme > request.nvme_budget) continue;
      // What the optimizer will do with the DRAM left over: keep the first spilled layers'
      // state (forward order) there, as much as fits (the prediction stages the rest).
      uint64_t spare = request.dram_budget - dram(), kept = 0;
      for (std::size_t i = 0; i < n && spare > 0; ++i) {
        if (!h[i].state_on_nvme || L[i].state_tier != -1) continue;
        h[i].state_in_dram = std::min(spare, L[i].state_bytes);
        spare -= h[i].state_in_dram;
        kept += h[i].state_in_dram;
      }
      Placement c;
      c.homes = std::move(h);
      c.staging_slots = any_staged ? slots : 0;
      c.slot_bytes = f.slot;
      c.grad_fetch_bytes = f.fetch;
      c.dram_bytes = dram() + kept;
      c.nvme_bytes = f.nvme - kept;
      c.prediction = predict_step(request, c.homes, c.staging_slots);
      const double a = c.prediction.step_seconds;
      slower = a >= best_here ? slower + 1 : 0;
      best_here = std::min(best_here, a);
      fits.push_back(std::move(c));
      if (!any_staged) break;  // nothing on NVMe: neither slots nor more weights out help
    }
    if (!nvme) break;
  }
  if (fits.empty() && least_nvme != std::numeric_limits<uint64_t>::max()) {
    return error(Code::kOutOfMemory,
                 "no placement fits: with what DRAM holds, NVMe needs at "
                 "least ",
                 least_nvme, " bytes (", gib(least_nvme), ") and the budget is ",
                 request.nvme_budget, " (", gib(request.nvme_budget), ")");
  }
  if (fits.empty()) {
    return error(Code::kOutOfMemory, "no placement fits: DRAM needs at least ", least_dram,
                 " bytes (", gib(least_dram), ": the grads in DRAM or their fetch buffer, ",
                 nvme ? "one staging slot and what cannot go to NVMe" : "weights and state",
                 ") and the budget is ", request.dram_budget, " (", gib(request.dram_budget), ")",
                 nvme ? "" : "; an NVMe budget lets state and weights spill");
  }
  // The fastest; of those within 1% of it, the fewest bytes on NVMe, then the fewest slots,
  // then the faster.
  double fastest = std::numeric_limits<double>::infinity();
  for (const Placement& c : fits) fastest = std::min(fastest, c.prediction.step_seconds);
  std::size_t pick = fits.size();
  for (std::size_t i = 0; i < fits.size(); ++i) {
    const Placement& c = fits[i];
    if (c.prediction.step_seconds > fastest * 1.01) continue;
    const bool better = pick == fits.size() || c.nvme_bytes < fits[pick].nvme_bytes ||
                        (c.nvme_bytes == fits[pick].nvme_bytes &&
                         (c.staging_slots < fits[pick].staging_slots ||
                          (c.staging_slots == fits[pick].staging_slots &&
                           c.prediction.step_seconds < fits[pick].prediction.step_seconds)));
    if (better) pick = i;
  }
  Placement best = std::move(fits[pick]);
  best.candidates = static_cast<uint32_t>(fits.size());
  best.rates = request.rates;
  for (std::size_t i = 0; i < n; ++i) {
    best.names.push_back(layer_name(request, i));
    best.grads_in_hbm.push_back(request.layers[i].grad_tier == kGradsInHbm);
  }
  *out = std::move(best);
  return Status::ok();
}

std::string placement_to_json(const Placement& pl) {
  const StepPrediction& p = pl.prediction;
  std::ostringstream o;
  o << std::setprecision(6) << "{\"staging_slots\": " << pl.staging_slots
    << ", \"slot_bytes\": " << pl.slot_bytes << ", \"grad_fetch_bytes\": " << pl.grad_fetch_bytes
    << ", \"dram_bytes\": " << pl.dram_bytes << ", \"nvme_bytes\": " << pl.nvme_bytes
    << ", \"candidates\": " << pl.candidates << ", \"rates\": {\"h2d\": " << pl.rates.h2d
    << ", \"d2h\": " << pl.rates.d2h << ", \"nvme_read\": " << pl.rates.nvme_read
    << ", \"nvme_write\": " << pl.rates.nvme_write << ", \"nvme_mixed\": " << pl.rates.nvme_mixed
    << ", \"update_elements\": " << pl.rates.update_elements << "}"
    << ", \"predicted\": {\"step_seconds\": " << p.step_seconds
    << ", \"bottleneck\": " << json_string(p.bottleneck) << ", \"compute\": " << p.compute
    << ", \"h2d\": " << p.h2d << ", \"d2h\": " << p.d2h << ", \"nvme_read\": " << p.nvme_read
    << ", \"nvme_write\": " << p.nvme_write << ", \"update\": " << p.update
    << ", \"gpu_wait\": " << p.gpu_wait << ", \"update_wait\": " << p.update_wait
    << "}, \"layers\": [";
  for (std::size_t i = 0; i < pl.homes.size(); ++i) {
    o << (i ? ", " : "") << "{\"name\": " << json_string(pl.names[i]) << ", \"weights\": \""
      << (pl.homes[i].weights_on_nvme ? "nvme" : "dram") << "\", \"state\": \""
      << (pl.homes[i].state_on_nvme ? "nvme" : "dram") << "\", \"grads\": \""
      << (pl.grads_in_hbm[i] ? "hbm" : "dram")
      << "\", \"state_in_dram\": " << pl.homes[i].state_in_dram << "}";
  }
  o << "]}";
  return o.str();
}

std::string placement_to_text(const Placement& pl) {
  const StepPrediction& p = pl.prediction;
  std::size_t state_nvme = 0, weights_nvme = 0;
  for (const LayerHome& h : pl.homes) {
    state_nvme += h.state_on_nvme;
    weights_nvme += h.weights_on_nvme;
  }
  std::ostringstream o;
  o << std::fixed << std::setprecision(3);
  o << "Strata placement: " << pl.homes.size() << " layers; state of " << state_nvme
    << " and weights of " << weights_nvme << " on NVMe; " << pl.staging_slots
    << " staging slot(s) of " << gib(pl.slot_bytes)
    << (pl.grad_fetch_bytes ? "; grads in HBM read through " + gib(pl.grad_fetch_bytes) : "")
    << "; DRAM " << gib(pl.dram_bytes) << ", NVMe " << gib(pl.nvme_bytes) << " (" << pl.candidates
    << " placements compared)\n";
  o << "  predicted step " << p.step_seconds << " s, bottleneck " << p.bottleneck
    << " (busy: compute " << p.compute << " s, h2d " << p.h2d << " s, d2h " << p.d2h
    << " s, nvme read " << p.nvme_read << " s, write " << p.nvme_write << " s, update " << p.update
    << " s; the GPU waits " << p.gpu_wait << " s, updates wait for state " << p.update_wait
    << " s)\n";
  o << std::setprecision(2) << "  rates: h2d " << pl.rates.h2d / 1e9 << " GB/s, d2h "
    << pl.rates.d2h / 1e9 << " GB/s, nvme read " << pl.rates.nvme_read / 1e9 << " GB/s, write "
    << pl.rates.nvme_write / 1e9 << " GB/s, mixed x" << pl.rates.nvme_mixed << ", update "
    << pl.rates.update_elements / 1e9 << " G elements/s\n";
  // Runs of layers with the same homes, so an 80-layer model stays a few lines.
  for (std::size_t i = 0; i < pl.homes.size();) {
    std::size_t j = i;
    while (j + 1 < pl.homes.size() &&
           pl.homes[j + 1].weights_on_nvme == pl.homes[i].weights_on_nvme &&
           pl.homes[j + 1].state_on_nvme == pl.homes[i].state_on_nvme &&
           pl.grads_in_hbm[j + 1] == pl.grads_in_hbm[i])
      ++j;
    o << "  " << pl.names[i] << (j > i ? " .. " + pl.names[j] : "") << ": weights "
      << (pl.homes[i].weights_on_nvme ? "nvme" : "dram") << ", state "
      << (pl.homes[i].state_on_nvme ? "nvme" : "dram") << ", grads "
      << (pl.grads_in_hbm[i] ? "hbm" : "dram") << "\n";
    i = j + 1;
  }
  return o.str();
}

}  // namespace strata
