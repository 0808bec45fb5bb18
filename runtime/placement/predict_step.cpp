// predict_step: the step that given homes and staging slots would take, predicted by building
// the executor's and the optimizer's work of a few steps as one task graph (loads and grads on
// PCIe, the compute, the CPU's updates, the disk's reads and writes, the staging slots) and
// timing it on the list scheduler (schedule.h).
#include <algorithm>
#include <cstddef>
#include <iterator>
#include <utility>
#include <vector>

#include "runtime/placement/placement.h"
#include "runtime/placement/placement_internal.h"
#include "runtime/placement/schedule.h"

namespace strata {

using namespace placement_detail;

namespace {

double seconds(uint64_t bytes, double rate, double factor = 1) {
  return rate > 0 ? static_cast<double>(bytes) / rate * factor : 0;
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

}  // namespace strata
