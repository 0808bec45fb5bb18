// Sequence tiles: at a long sequence one block's backward working set (what its recompute
// saves, then frees as its backward runs) is dominated by its MLP's intermediates, one per
// token of the whole batch: an 8B Llama at 128k tokens holds 14336 x 128k x 2 bytes = 3.5 GiB
// for each of gate, up, the activation and their product, and their grads beside them. The MLP
// is per token (no token reads another), so running it over tiles of the sequence, each tile
// recomputed in the backward pass from the MLP's saved input (ALST's TiledMLP), gives the same
// values and holds one tile's intermediates at a time. The rest of the block's working set
// (attention, in a kernel whose memory is linear in the sequence, the norms, the rotary
// tables) is not tiled.
#include <algorithm>
#include <iomanip>
#include <sstream>

#include "runtime/step/step_plan.h"

namespace strata::step {

uint64_t tile_tokens(uint64_t tokens, uint32_t tiles) {
  if (tiles <= 1) return tokens;
  return tokens / tiles + (tokens % tiles != 0);
}

uint64_t block_working(const StepProfile& p, uint32_t tiles) {
  if (!p.block_saved_measured) return sat_mul(kUnmeasuredBlockFactor, p.checkpoint_bytes);
  // The MLP's part of the saved bytes scales with a tile's tokens; the rest with the batch.
  const uint64_t mlp_whole = sat_mul(p.mlp_token_bytes, p.tokens);
  const uint64_t rest = p.block_saved_bytes - std::min(mlp_whole, p.block_saved_bytes);
  const uint64_t mlp_tile = sat_mul(p.mlp_token_bytes, tile_tokens(p.tokens, tiles));
  const uint64_t saved = sat_add(rest, std::min(mlp_tile, mlp_whole));
  return sat_add(static_cast<uint64_t>(static_cast<double>(saved) * kBlockFactor),
                 sat_mul(2, p.checkpoint_bytes));
}

uint32_t most_tiles(const StepProfile& p) {
  if (p.given_tiles != 0) return p.given_tiles;
  if (p.mlp_token_bytes == 0 || !p.block_saved_measured) return 1;
  return static_cast<uint32_t>(
      std::clamp<uint64_t>(p.tokens / kMinTileTokens, 1, uint64_t{UINT32_MAX}));
}

uint32_t choose_tiles(const StepProfile& p, const std::function<bool(uint32_t)>& fits,
                      const std::function<uint64_t(uint32_t)>& peak) {
  if (p.given_tiles != 0) return p.given_tiles;
  const uint32_t most = most_tiles(p);
  if (most <= 1 || fits(1)) return 1;
  // The working set only shrinks as tiles grow, and the spills chosen with it fit as well or
  // better: the fewest tiles that fit is found by halving the range.
  const bool any = fits(most);
  const uint64_t best = any ? 0 : peak(most);
  const auto good = [&](uint32_t t) { return any ? fits(t) : peak(t) <= best; };
  uint32_t low = 1, high = most;  // good(high) holds, good(low) does not (or low is 1)
  if (!any && good(1)) return 1;  // tiles would not lower the peak
  while (high - low > 1) {
    const uint32_t mid = low + (high - low) / 2;
    (good(mid) ? high : low) = mid;
  }
  return high;
}

std::string tiles_reason(const StepProfile& p, uint32_t tiles, bool fits) {
  std::ostringstream o;
  const uint64_t tile = tile_tokens(p.tokens, tiles);
  const uint64_t mlp_whole = sat_mul(p.mlp_token_bytes, p.tokens);
  o << "mlp: " << tiles << (tiles == 1 ? " tile" : " tiles") << " of " << tile << " tokens";
  if (p.given_tiles != 0) {
    o << " (given)";
  } else if (p.mlp_token_bytes == 0 || !p.block_saved_measured) {
    o << ": the MLP's bytes per token were not measured, it runs whole";
    return o.str();
  } else if (tiles == 1) {
    o << ": one block's backward working set of " << size_text(block_working(p, 1))
      << " fits whole (the MLP's " << size_text(mlp_whole) << " at " << p.tokens << " tokens)";
    return o.str();
  }
  if (p.mlp_token_bytes != 0 && p.block_saved_measured) {
    o << ": one block's backward working set " << size_text(block_working(p, tiles)) << " tiled, "
      << size_text(block_working(p, 1)) << " whole (the MLP's " << size_text(p.mlp_token_bytes)
      << " a token: " << size_text(mlp_whole) << " at " << p.tokens << " tokens, "
      << size_text(sat_mul(p.mlp_token_bytes, tile)) << " a tile; the rest of the block "
      << size_text(p.block_saved_bytes - mlp_whole) << ", not tiled)";
    if (p.given_tiles == 0) {
      o << (fits ? "; the fewest tiles with which the step fits"
                 : "; short even so: the tiles that lower the peak most");
    }
  }
  return o.str();
}

}  // namespace strata::step
