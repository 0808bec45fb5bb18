// Checkpoints: the whole training state in a directory of safetensors files, written straight
// from the tiers and replaced atomically (see strata.h for the format and guarantees).
#pragma once

#include <string>

#include "runtime/optimizer/optimizer.h"
#include "runtime/runtime.h"

namespace strata {

inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";

// optimizer may be null (weights only).
Status save_checkpoint(Runtime& runtime, Optimizer* optimizer, const std::string& path);
Status load_checkpoint(Runtime& runtime, Optimizer* optimizer, const std::string& path);

}  // namespace strata
