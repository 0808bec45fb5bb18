// The optimizer's element-wise kernels: AdamW (and Adam), SGD, Lion and Adagrad over fp32
// masters and state, reading
// grads in their streamed dtype and writing the streamed working copy. Each kernel exists once
// per instruction set (AVX-512, AVX2, baseline x86-64), compiled from one template with
// different flags; the best the CPU supports is chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/types.h"

namespace strata::optim {

enum class Isa : int32_t { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
std::string_view isa_name(Isa isa);
// The widest the CPU runs (STRATA_OPTIMIZER_ISA=generic|avx2|avx512 may lower it).
Isa best_isa();
bool isa_supported(Isa isa);

// One parameter's arrays, all `count` elements long. Pointers not used by a kernel may be null.
struct ParamArrays {
  float* master = nullptr;      // fp32 master weights (may be the working copy itself); null
                                // when the master is split (master_low)
  float* exp_avg = nullptr;     // AdamW/Adam/Lion m, SGD momentum buffer
  float* exp_avg_sq = nullptr;  // AdamW/Adam v, Adagrad sum
  const void* grad = nullptr;   // as it left the GPU
  DType grad_dtype = DType::kF32;
  float* grad_accum = nullptr;  // fp32 sum of earlier micro-steps' grads; added when non-null
  void* weight = nullptr;       // working copy written from the master; null when it is the master
  DType weight_dtype = DType::kF32;
  std::size_t count = 0;
  // A split master (docs/optimizer.md): the fp32 master is the bf16 `weight`'s bits followed by
  // these signed 16-bit remainders, master = bits(weight) << 16 + master_low (kernels_impl.h's
  // load_split/store_split). Set only with a bf16 weight, and then `master` is null.
  int16_t* master_low = nullptr;
};

// Per-step scalars. The grad used is (grad + grad_accum) * grad_scale, where grad_scale folds
// loss-scale removal and global-norm clipping into one multiply.
struct AdamWScalars {
  float grad_scale = 1.f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float lr_decay = 0.f;        // lr * weight_decay (decoupled): p -= p * lr_decay
  float step_size = 0.f;       // lr / (1 - beta1^t)
  float inv_bias2_sqrt = 1.f;  // 1 / sqrt(1 - beta2^t)
  float l2 = 0.f;              // Adam (torch.optim.Adam): weight_decay added to the grad
};

struct SgdScalars {
  float grad_scale = 1.f;
  float lr = 0.f;
  float weight_decay = 0.f;  // L2, added to the grad (PyTorch's SGD)
  float momentum = 0.f;
  float dampening = 0.f;
  bool nesterov = false;
  bool first_step = false;  // the momentum buffer starts as the first grad
};

// Lion (Chen et al. 2023; lucidrains/lion-pytorch): p = p * keep - lr * sign(lerp(m, g, 1 -
// beta1)), m = lerp(m, g, 1 - beta2).
struct LionScalars {
  float grad_scale = 1.f;
  float lr = 0.f;
  float beta1 = 0.9f, beta2 = 0.99f;
  float keep = 1.f;  // 1 - lr * weight_decay (decoupled), rounded once as torch's mul_ does
};

// Adagrad (torch.optim.Adagrad): g += weight_decay * p, sum += g^2,
// p -= lr * g / (sqrt(sum) + eps), lr already decayed (lr / (1 + (t - 1) * lr_decay)).
struct AdagradScalars {
  float grad_scale = 1.f;
  float lr = 0.f;
  float weight_decay = 0.f;
  float eps = 1e-10f;
};

// One update's scalars, whichever the optimizer's kind: it fills its kind's member.
struct UpdateScalars {
  AdamWScalars adamw;  // AdamW and Adam
  SgdScalars sgd;
  LionScalars lion;
  AdagradScalars adagrad;
};

struct KernelTable {
  Isa isa;
  // Update elements [begin, end) of one parameter.
  void (*adamw)(const AdamWScalars&, const ParamArrays&, std::size_t begin, std::size_t end);
  void (*sgd)(const SgdScalars&, const ParamArrays&, std::size_t begin, std::size_t end);
  void (*lion)(const LionScalars&, const ParamArrays&, std::size_t begin, std::size_t end);
  void (*adagrad)(const AdagradScalars&, const ParamArrays&, std::size_t begin, std::size_t end);
  // Sum of squares of (grad + grad_accum) over [begin, end), unscaled; inf/NaN if any is.
  double (*sum_squares)(const ParamArrays&, std::size_t begin, std::size_t end);
  // grad_accum = grad (first) or grad_accum += grad, over [begin, end).
  void (*accumulate)(const ParamArrays&, std::size_t begin, std::size_t end, bool first);
  // out = the fp32 master over [begin, end) (split, separate, or an fp32 `master` alone).
  void (*master_get)(const ParamArrays&, float* out, std::size_t begin, std::size_t end);
  // The master = in, and the working copy (`weight`, when set) rounded from it, as an update
  // writes them.
  void (*master_set)(const ParamArrays&, const float* in, std::size_t begin, std::size_t end);
};

const KernelTable& kernels(Isa isa);

// Whether a dtype can be a grad or a working copy (fp32, bf16, fp16).
inline bool float_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

}  // namespace strata::optim
