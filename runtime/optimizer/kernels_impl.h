// The kernels' one source, included by kernels_{generic,avx2,avx512}.cpp, each compiled for
// its instruction set. Plain loops over restrict pointers that GCC vectorizes (checked with
// -fopt-info-vec when they change): one pass per parameter range, every array read and written
// once, so the update runs at memory speed. Dtype conversions are inline bit operations
// (bf16: round to nearest even, as PyTorch's .to(bfloat16)); fp16 uses _Float16, which F16C
// converts in hardware on the AVX builds (clang < 15 has no _Float16 on x86: there fp16 is
// converted by half.h's integer operations, bit for bit the same).
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "runtime/optimizer/kernels.h"

#if defined(__clang__) && __clang_major__ < 15 && (defined(__x86_64__) || defined(__i386__))
#define STRATA_SOFT_F16 1
#include "runtime/optimizer/half.h"
#endif

#ifndef STRATA_KERNEL_NS
#error "define STRATA_KERNEL_NS before including kernels_impl.h"
#endif

namespace strata::optim::STRATA_KERNEL_NS {
namespace {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
#ifdef STRATA_SOFT_F16
  uint16_t bits;
#else
  _Float16 value;
#endif
};

inline float load(const float* p, std::size_t i) {
  return p[i];
}
inline float load(const Bf16* p, std::size_t i) {
  return std::bit_cast<float>(static_cast<uint32_t>(p[i].bits) << 16);
}
inline float load(const F16* p, std::size_t i) {
#ifdef STRATA_SOFT_F16
  return half_to_float(p[i].bits);
#else
  return static_cast<float>(p[i].value);
#endif
}

inline void store(float* p, std::size_t i, float x) {
  p[i] = x;
}
inline void store(Bf16* p, std::size_t i, float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // keep NaN a (quiet) NaN
  p[i].bits = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}
inline void store(F16* p, std::size_t i, float x) {
#ifdef STRATA_SOFT_F16
  p[i].bits = half_from_float(x);
#else
  p[i].value = static_cast<_Float16>(x);
#endif
}

// The grad as the update sees it, before grad_scale.
template <typename G>
inline float raw_grad(const G* __restrict g, const float* __restrict acc, std::size_t i) {
  float x = load(g, i);
  if (acc != nullptr) x += acc[i];
  return x;
}

// The loop proper: every array a restrict parameter (not a lambda capture, through which GCC
// loses restrict and versions the loop for aliasing), the accumulator a compile-time choice.
template <typename G, typename W, bool kAccum>
void adamw_loop(const AdamWScalars& s, float* __restrict master, float* __restrict m,
                float* __restrict v, const G* __restrict g, const float* __restrict acc,
                W* __restrict w, std::size_t begin, std::size_t end) {
  const float omb1 = 1.f - s.beta1, b2 = s.beta2, omb2 = 1.f - s.beta2;
  const float scale = s.grad_scale, lr_decay = s.lr_decay, step = s.step_size;
  const float ib2 = s.inv_bias2_sqrt, eps = s.eps;
  // PyTorch's operation order: decay, lerp m toward g, v = b2 v + (1-b2) g^2,
  // p -= step * m / (sqrt(v) / sqrt(bias2) + eps).
  for (std::size_t i = begin; i < end; ++i) {
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    gi *= scale;
    const float mi = m[i] + omb1 * (gi - m[i]);
    const float vi = v[i] * b2 + omb2 * (gi * gi);
    const float denom = std::sqrt(vi) * ib2 + eps;
    // p - p * lr_decay rather than p * (1 - lr_decay): the rounding of (1 - lr_decay) would
    // bias every step the same way (1e-6 relative after 20 steps); this keeps it at 1 ulp.
    const float p0 = master[i];
    const float p = (p0 - p0 * lr_decay) - step * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if constexpr (!std::is_same_v<W, void>) store(w, i, p);
  }
}

template <typename G, typename W>
void adamw_typed(const AdamWScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* g = static_cast<const G*>(a.grad);
  W* w = static_cast<W*>(a.weight);
  if (a.grad_accum != nullptr) {
    adamw_loop<G, W, true>(s, a.master, a.exp_avg, a.exp_avg_sq, g, a.grad_accum, w, begin, end);
  } else {
    adamw_loop<G, W, false>(s, a.master, a.exp_avg, a.exp_avg_sq, g, nullptr, w, begin, end);
  }
}

template <typename G, typename W, bool kAccum, bool kMomentum>
void sgd_loop(const SgdScalars& s, float* __restrict master, float* __restrict buf,
              const G* __restrict g, const float* __restrict acc, W* __restrict w,
              std::size_t begin, std::size_t end) {
  const float scale = s.grad_scale, lr = s.lr, wd = s.weight_decay, mom = s.momentum;
  const float omd = 1.f - s.dampening;
  const bool first = s.first_step, nesterov = s.nesterov;
  for (std::size_t i = begin; i < end; ++i) {
    const float p = master[i];
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    float d = gi * scale + wd * p;
    if constexpr (kMomentum) {
      const float b = first ? d : mom * buf[i] + omd * d;
      buf[i] = b;
      d = nesterov ? d + mom * b : b;
    }
    const float np = p - lr * d;
    master[i] = np;
    if constexpr (!std::is_same_v<W, void>) store(w, i, np);
  }
}

template <typename G, typename W>
void sgd_typed(const SgdScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* g = static_cast<const G*>(a.grad);
  W* w = static_cast<W*>(a.weight);
  const bool momentum = a.exp_avg != nullptr && s.momentum != 0.f;
  const bool accum = a.grad_accum != nullptr;
  if (momentum && accum) {
    sgd_loop<G, W, true, true>(s, a.master, a.exp_avg, g, a.grad_accum, w, begin, end);
  } else if (momentum) {
    sgd_loop<G, W, false, true>(s, a.master, a.exp_avg, g, nullptr, w, begin, end);
  } else if (accum) {
    sgd_loop<G, W, true, false>(s, a.master, nullptr, g, a.grad_accum, w, begin, end);
  } else {
    sgd_loop<G, W, false, false>(s, a.master, nullptr, g, nullptr, w, begin, end);
  }
}

template <typename G>
double sum_squares_typed(const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* __restrict g = static_cast<const G*>(a.grad);
  const float* __restrict acc = a.grad_accum;
  // Per-lane fp32 partial sums over short blocks (vectorizes without reassociating), added up
  // in double: accurate for billions of elements without a double-width inner loop.
  constexpr std::size_t kLanes = 16, kBlock = 1024;
  double total = 0;
  std::size_t b = begin;
  for (; b + kBlock <= end; b += kBlock) {
    float lanes[kLanes] = {};
    for (std::size_t i = b; i < b + kBlock; i += kLanes) {
      for (std::size_t j = 0; j < kLanes; ++j) {
        const float x = raw_grad(g, acc, i + j);
        lanes[j] += x * x;
      }
    }
    for (float l : lanes) total += l;
  }
  for (; b < end; ++b) {
    const double x = raw_grad(g, acc, b);
    total += x * x;
  }
  return total;
}

template <typename G>
void accumulate_typed(const ParamArrays& a, std::size_t begin, std::size_t end, bool first) {
  const G* __restrict g = static_cast<const G*>(a.grad);
  float* __restrict acc = a.grad_accum;
  if (first) {
    for (std::size_t i = begin; i < end; ++i) acc[i] = load(g, i);
  } else {
    for (std::size_t i = begin; i < end; ++i) acc[i] += load(g, i);
  }
}

// Dtype dispatch: one branch per call (a parameter range), never per element.
template <template <typename, typename> class Op, typename... Args>
void by_dtypes(DType grad, DType weight, bool has_weight, Args&&... args) {
  auto with_grad = [&]<typename G>() {
    if (!has_weight) return Op<G, void>::run(args...);
    switch (weight) {
      case DType::kBF16:
        return Op<G, Bf16>::run(args...);
      case DType::kF16:
        return Op<G, F16>::run(args...);
      default:
        return Op<G, float>::run(args...);
    }
  };
  switch (grad) {
    case DType::kBF16:
      return with_grad.template operator()<Bf16>();
    case DType::kF16:
      return with_grad.template operator()<F16>();
    default:
      return with_grad.template operator()<float>();
  }
}

template <typename G, typename W>
struct AdamWOp {
  static void run(const AdamWScalars& s, const ParamArrays& a, std::size_t b, std::size_t e) {
    adamw_typed<G, W>(s, a, b, e);
  }
};
template <typename G, typename W>
struct SgdOp {
  static void run(const SgdScalars& s, const ParamArrays& a, std::size_t b, std::size_t e) {
    sgd_typed<G, W>(s, a, b, e);
  }
};

void adamw(const AdamWScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtypes<AdamWOp>(a.grad_dtype, a.weight_dtype, a.weight != nullptr, s, a, begin, end);
}
void sgd(const SgdScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtypes<SgdOp>(a.grad_dtype, a.weight_dtype, a.weight != nullptr, s, a, begin, end);
}
double sum_squares(const ParamArrays& a, std::size_t begin, std::size_t end) {
  switch (a.grad_dtype) {
    case DType::kBF16:
      return sum_squares_typed<Bf16>(a, begin, end);
    case DType::kF16:
      return sum_squares_typed<F16>(a, begin, end);
    default:
      return sum_squares_typed<float>(a, begin, end);
  }
}
void accumulate(const ParamArrays& a, std::size_t begin, std::size_t end, bool first) {
  switch (a.grad_dtype) {
    case DType::kBF16:
      return accumulate_typed<Bf16>(a, begin, end, first);
    case DType::kF16:
      return accumulate_typed<F16>(a, begin, end, first);
    default:
      return accumulate_typed<float>(a, begin, end, first);
  }
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t{STRATA_KERNEL_ISA, &adamw, &sgd, &sum_squares, &accumulate};
  return t;
}

}  // namespace strata::optim::STRATA_KERNEL_NS
