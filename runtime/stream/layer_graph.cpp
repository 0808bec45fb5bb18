#include "runtime/stream/layer_graph.h"

namespace strata {

std::vector<StepPosition> step_sequence(uint32_t layers) {
  std::vector<StepPosition> out;
  for (uint32_t l = 0; l < layers; ++l) out.push_back({Phase::kForward, l});
  for (uint32_t l = layers; l-- > 0;) out.push_back({Phase::kBackward, l});
  return out;
}

std::vector<ScheduledPosition> schedule_slots(const std::vector<StepPosition>& sequence,
                                              uint32_t slots, uint32_t depth) {
  struct SlotState {
    int layer = -1;
    int last_position = -1;  // the last position that claimed it
  };
  std::vector<SlotState> state(slots);
  std::vector<ScheduledPosition> out(sequence.size());
  for (std::size_t p = 0; p < sequence.size(); ++p) {
    // When p is issued, positions up to p - depth - 1 have been released; positions
    // p - depth .. p - 1 still hold their slots.
    const int oldest_held = static_cast<int>(p) - static_cast<int>(depth);
    auto held = [&](const SlotState& s) {
      return s.last_position >= oldest_held && s.last_position >= 0;
    };
    const int layer = static_cast<int>(sequence[p].layer);
    int chosen = -1;
    for (uint32_t s = 0; s < slots; ++s) {
      if (state[s].layer == layer) chosen = static_cast<int>(s);  // still there: reuse
    }
    bool reuse = chosen >= 0;
    if (!reuse) {
      // The free slot used longest ago, so recently used layers stay for possible reuse.
      for (uint32_t s = 0; s < slots; ++s) {
        if (held(state[s])) continue;
        if (chosen < 0 ||
            state[s].last_position < state[static_cast<uint32_t>(chosen)].last_position) {
          chosen = static_cast<int>(s);
        }
      }
    }
    SlotState& slot = state[static_cast<uint32_t>(chosen)];
    out[p].slot = static_cast<uint32_t>(chosen);
    out[p].reuse = reuse;
    out[p].previous_in_slot = slot.last_position;
    slot.layer = layer;
    slot.last_position = static_cast<int>(p);
  }
  return out;
}

}  // namespace strata
