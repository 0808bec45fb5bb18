// Residency and the host budget's split: the step plan's decisions made before any batch runs.
#include <algorithm>
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

// As many of the first blocks as fit in kResidentShare of the device memory left beside
// Strata's own HBM tier and the rest of the model (its embedding and head with their optimizer
// state, at the resident bytes per parameter: a 128k-vocabulary 8B Llama's take 17 GB; left out,
// 7 blocks were kept on an 80 GB GPU and the first step ran out of memory); the rest of the
// device is for activations, logits and the allocator. Resident blocks need no transfers and
// are updated on the device at once, so the CPU's updates of the streamed ones start with the
// resident blocks' forward pass as a head start. With the streamed grads in HBM their bytes come
// out of that share first (a block kept resident gives its grads' share back: its own grad is in
// the resident bytes per parameter). At least one block streams. None without a device.
uint32_t choose_resident(const StepProfile& profile, std::string* why) {
  const auto& blocks = profile.blocks;
  if (profile.device_total == 0 || blocks.empty()) {
    if (why != nullptr) *why = "residency: no device memory to keep blocks in";
    return 0;
  }
  const uint64_t per_param = profile.resident_bytes_per_param;
  const uint64_t coming = profile.outside_elements * per_param;
  const uint64_t free = profile.device_free > coming ? profile.device_free - coming : 0;
  const uint64_t left = free > profile.hbm_tier_bytes ? free - profile.hbm_tier_bytes : 0;
  int64_t spare = static_cast<int64_t>(left * kResidentShareNumerator / kResidentShareDenominator);
  spare -= static_cast<int64_t>(profile.streamed_grads_hbm_bytes);
  uint32_t k = 0;
  for (std::size_t i = 0; i + 1 < blocks.size(); ++i) {
    const uint64_t mine = blocks[i].rank_elements ? blocks[i].rank_elements : blocks[i].elements;
    const int64_t need = static_cast<int64_t>(blocks[i].elements * per_param) -
                         static_cast<int64_t>(mine * profile.streamed_grad_bytes_per_param);
    if (need > spare) break;
    spare -= need;
    ++k;
  }
  if (why != nullptr) {
    std::ostringstream o;
    o << std::fixed << std::setprecision(2);
    o << "residency: " << k << " of " << blocks.size()
      << " blocks resident: " << kResidentShareNumerator * 100 / kResidentShareDenominator
      << "% of the " << size_text(left) << " the device has free beside Strata's HBM tier ("
      << size_text(profile.hbm_tier_bytes) << ") and the rest of the model (" << size_text(coming)
      << " at " << per_param << " B/param)";
    if (profile.streamed_grads_hbm_bytes) {
      o << ", less the streamed grads in HBM (" << size_text(profile.streamed_grads_hbm_bytes)
        << ")";
    }
    o << ", at " << per_param << " B/param a resident block; at least one block streams";
    *why = o.str();
  }
  return k;
}

// host_budget as a promise: the user's, or the arena, what the binding holds beside it, and
// kPoolShare of this process's share of the host memory available once the arena is made (the
// ranks of a host each make such a budget: together they take kPoolShare of it, not k times).
uint64_t host_total(const StepProfile& profile) {
  if (profile.host_budget != 0) return profile.host_budget;
  const uint64_t ranks = std::max<uint32_t>(profile.ranks_on_host, 1);
  const uint64_t mine = profile.host_available / ranks;
  const uint64_t share = mine > profile.beside_bytes ? mine - profile.beside_bytes : 0;
  return profile.arena_bytes + profile.beside_bytes +
         static_cast<uint64_t>(kPoolShare * static_cast<double>(share));
}

// The most tokens whose fp32 logits fit in kLossChunkBytes, a multiple of 8 (the products' row
// tiles) when there are at least 8, at least 1.
uint64_t default_loss_chunk(uint64_t vocab) {
  if (vocab == 0) return 0;
  const uint64_t tokens = std::max<uint64_t>(1, kLossChunkBytes / (4 * vocab));
  return tokens >= 8 ? tokens - tokens % 8 : tokens;
}

}  // namespace strata::step
