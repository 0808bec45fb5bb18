// What the optimizer's source files share beyond optimizer.h (which declares the class; each
// optimizer_*.cpp holds one of its jobs). Private to runtime/optimizer/.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace strata {

// Where each state array starts within a 4 KiB page (master, exp_avg, exp_avg_sq, grad_accum;
// the weight and grad, registered by the framework, start at 0). The update streams all of
// them at once: at equal page offsets they collide in the caches (4K aliasing).
inline constexpr uint64_t kSkew[4] = {1088, 2176, 3264, 576};

// A config value `what` = v must be finite and >= lo (> lo unless lo_inclusive): the checks of
// OptimizerConfig and of a param group's hyperparameters.
Status check_finite(const char* what, float v, float lo, bool lo_inclusive);
// AdamW's beta1 and beta2 in [0, 1), eps finite and above 0.
Status check_betas(float beta1, float beta2, float eps);

}  // namespace strata
