// A placement written out (strata_placement_dump): one JSON object for tools, a few lines of text
// for people; the choice, the prediction, the rates and the homes.
#include <cstddef>
#include <iomanip>
#include <sstream>
#include <string>

#include "common/json.h"
#include "runtime/placement/placement.h"
#include "runtime/placement/placement_internal.h"

namespace strata {

using placement_detail::gib;

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
