// Once a step's grad norms are in: skip on overflow, clip, and move the dynamic loss scale
// (PyTorch's GradScaler and clip_grad_norm_).
#include "runtime/optimizer/optimizer.h"

#include <algorithm>
#include <cmath>

namespace strata {

void Optimizer::finish_norms(double total_squared, StepScalars* s) {
  const float scale = counters_.loss_scale;
  last_norm_ = std::sqrt(total_squared) / scale;
  if (!std::isfinite(total_squared)) {
    // Overflowed grads: no update this step (t does not advance), and a smaller scale.
    s->skip = true;
    ++counters_.skipped_steps;
    if (config_.dynamic_loss_scale) {
      counters_.loss_scale = scale * config_.backoff_factor;
      counters_.growth_tracker = 0;
    }
    return;
  }
  double coef = 1.0;
  if (config_.max_grad_norm > 0) {
    // PyTorch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
    coef = std::min(1.0, static_cast<double>(config_.max_grad_norm) / (last_norm_ + 1e-6));
  }
  s->grad_scale = static_cast<float>(coef / scale);
  counters_.step = s->t;
  if (config_.dynamic_loss_scale && ++counters_.growth_tracker >= config_.growth_interval) {
    counters_.loss_scale = scale * config_.growth_factor;
    counters_.growth_tracker = 0;
  }
}

}  // namespace strata
