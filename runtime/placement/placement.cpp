// choose_placement: the request's checks, then the search over homes and staging slots that
// the budgets allow (each candidate's step predicted by predict_step.cpp), and the pick.
#include "runtime/placement/placement.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "runtime/placement/placement_internal.h"

namespace strata {

using namespace placement_detail;

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

}  // namespace strata
