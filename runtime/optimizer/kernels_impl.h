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
// x rounded to bf16 (nearest, ties to even), as the bits of a float's upper half.
inline uint32_t bf16_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // keep NaN a (quiet) NaN
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}
inline void store(Bf16* p, std::size_t i, float x) {
  p[i].bits = static_cast<uint16_t>(bf16_bits(std::bit_cast<uint32_t>(x)));
}

// The split master (ParamArrays::master_low): the bf16 weight is the master rounded to nearest
// even, exactly what store(Bf16*) writes, and the remainder u - (weight << 16) is kept as a
// signed 16-bit number. It always fits but in one case: a master exactly halfway between two
// bf16 values that rounded down to the even one (+0x8000; rounding up leaves -0x8000, which
// fits). An even bf16 value is the nearest of 2^16 + 1 floats, one more than 16 bits name, so
// that master is kept one ulp nearer the weight (+0x7FFF): a relative change of 2^-24, in 1 of
// 2^17 updated values; the weight is the same. A NaN master keeps the weight's quiet NaN
// (remainder 0). A remainder that does not belong to the weight (the weight was written alone:
// a checkpoint's weights loaded without the optimizer, a framework's write) would put together
// a master that does not round to the weight, or a NaN (0 with a negative rest): then the
// master is the weight itself.
inline float load_split(const Bf16* w, const int16_t* low, std::size_t i) {
  const uint32_t hi = static_cast<uint32_t>(w[i].bits) << 16;
  const uint32_t u = hi + static_cast<uint32_t>(static_cast<int32_t>(low[i]));
  return std::bit_cast<float>((bf16_bits(u) << 16) == hi ? u : hi);
}
inline void store_split(Bf16* w, int16_t* low, std::size_t i, float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t hi = bf16_bits(u);
  const uint32_t rest = u - (hi << 16);  // the remainder, two's complement
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  w[i].bits = static_cast<uint16_t>(hi);
  low[i] = static_cast<int16_t>(nan ? 0u : rest == 0x8000u ? 0x7FFFu : (rest & 0xFFFFu));
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
// loses restrict and versions the loop for aliasing), the accumulator and the split master
// compile-time choices (kSplit: the master is w's bits and `low`, `master` unused).
template <typename G, typename W, bool kAccum, bool kSplit>
void adamw_loop(const AdamWScalars& s, float* __restrict master, int16_t* __restrict low,
                float* __restrict m, float* __restrict v, const G* __restrict g,
                const float* __restrict acc, W* __restrict w, std::size_t begin, std::size_t end) {
  const float omb1 = 1.f - s.beta1, b2 = s.beta2, omb2 = 1.f - s.beta2;
  const float scale = s.grad_scale, lr_decay = s.lr_decay, step = s.step_size;
  const float ib2 = s.inv_bias2_sqrt, eps = s.eps, l2 = s.l2;
  // PyTorch's operation order: (Adam) g += l2 p, decay, lerp m toward g,
  // v = b2 v + (1-b2) g^2, p -= step * m / (sqrt(v) / sqrt(bias2) + eps). AdamW has l2 = 0 and
  // Adam lr_decay = 0: adding 0 and subtracting p * 0 leave the other's values bit for bit.
  for (std::size_t i = begin; i < end; ++i) {
    float p0;
    if constexpr (kSplit) {
      p0 = load_split(w, low, i);
    } else {
      p0 = master[i];
    }
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    gi = gi * scale + l2 * p0;
    const float mi = m[i] + omb1 * (gi - m[i]);
    const float vi = v[i] * b2 + omb2 * (gi * gi);
    const float denom = std::sqrt(vi) * ib2 + eps;
    // p - p * lr_decay rather than p * (1 - lr_decay): the rounding of (1 - lr_decay) would
    // bias every step the same way (1e-6 relative after 20 steps); this keeps it at 1 ulp.
    const float p = (p0 - p0 * lr_decay) - step * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    if constexpr (kSplit) {
      store_split(w, low, i, p);
    } else {
      master[i] = p;
      if constexpr (!std::is_same_v<W, void>) store(w, i, p);
    }
  }
}

template <typename G, typename W>
void adamw_typed(const AdamWScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* g = static_cast<const G*>(a.grad);
  W* w = static_cast<W*>(a.weight);
  float* x = a.master;
  float* m = a.exp_avg;
  float* v = a.exp_avg_sq;
  const float* acc = a.grad_accum;
  if constexpr (std::is_same_v<W, Bf16>) {
    if (a.master_low != nullptr) {
      int16_t* lo = a.master_low;
      if (acc != nullptr)
        return adamw_loop<G, W, true, true>(s, x, lo, m, v, g, acc, w, begin, end);
      return adamw_loop<G, W, false, true>(s, x, lo, m, v, g, nullptr, w, begin, end);
    }
  }
  if (acc != nullptr)
    return adamw_loop<G, W, true, false>(s, x, nullptr, m, v, g, acc, w, begin, end);
  adamw_loop<G, W, false, false>(s, x, nullptr, m, v, g, nullptr, w, begin, end);
}

template <typename G, typename W, bool kAccum, bool kMomentum, bool kSplit>
void sgd_loop(const SgdScalars& s, float* __restrict master, int16_t* __restrict low,
              float* __restrict buf, const G* __restrict g, const float* __restrict acc,
              W* __restrict w, std::size_t begin, std::size_t end) {
  const float scale = s.grad_scale, lr = s.lr, wd = s.weight_decay, mom = s.momentum;
  const float omd = 1.f - s.dampening;
  const bool first = s.first_step, nesterov = s.nesterov;
  for (std::size_t i = begin; i < end; ++i) {
    float p;
    if constexpr (kSplit) {
      p = load_split(w, low, i);
    } else {
      p = master[i];
    }
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    float d = gi * scale + wd * p;
    if constexpr (kMomentum) {
      const float b = first ? d : mom * buf[i] + omd * d;
      buf[i] = b;
      d = nesterov ? d + mom * b : b;
    }
    const float np = p - lr * d;
    if constexpr (kSplit) {
      store_split(w, low, i, np);
    } else {
      master[i] = np;
      if constexpr (!std::is_same_v<W, void>) store(w, i, np);
    }
  }
}

template <typename G, typename W, bool kSplit>
void sgd_variant(const SgdScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* g = static_cast<const G*>(a.grad);
  W* w = static_cast<W*>(a.weight);
  float* x = a.master;
  int16_t* lo = a.master_low;
  const bool momentum = a.exp_avg != nullptr && s.momentum != 0.f;
  const bool accum = a.grad_accum != nullptr;
  float* buf = a.exp_avg;
  const float* acc = a.grad_accum;
  if (momentum && accum) {
    sgd_loop<G, W, true, true, kSplit>(s, x, lo, buf, g, acc, w, begin, end);
  } else if (momentum) {
    sgd_loop<G, W, false, true, kSplit>(s, x, lo, buf, g, nullptr, w, begin, end);
  } else if (accum) {
    sgd_loop<G, W, true, false, kSplit>(s, x, lo, nullptr, g, acc, w, begin, end);
  } else {
    sgd_loop<G, W, false, false, kSplit>(s, x, lo, nullptr, g, nullptr, w, begin, end);
  }
}

template <typename G, typename W>
void sgd_typed(const SgdScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  if constexpr (std::is_same_v<W, Bf16>) {
    if (a.master_low != nullptr) return sgd_variant<G, W, true>(s, a, begin, end);
  }
  sgd_variant<G, W, false>(s, a, begin, end);
}

// Lion and Adagrad: one loop each over restrict arrays (as adamw_loop), with the accumulator
// and the split master compile-time choices made by with_layout below.
template <typename G, typename W, bool kAccum, bool kSplit>
void lion_loop(const LionScalars& s, float* __restrict master, int16_t* __restrict low,
               float* __restrict m, const G* __restrict g, const float* __restrict acc,
               W* __restrict w, std::size_t begin, std::size_t end) {
  const float omb1 = 1.f - s.beta1, omb2 = 1.f - s.beta2;
  const float scale = s.grad_scale, lr = s.lr, keep = s.keep;
  // lion-pytorch's order: p *= 1 - lr wd; c = lerp(m, g, 1 - b1); p -= lr sign(c);
  // m = lerp(m, g, 1 - b2). sign(0) is 0 and a NaN stays NaN, as torch.sign.
  for (std::size_t i = begin; i < end; ++i) {
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    gi *= scale;
    const float mi = m[i];
    const float c = mi + omb1 * (gi - mi);
    // Selects of constants, every comparison made: nested (c > 0 ? 1 : c < 0 ? -1 : c) or
    // bool-to-float conversions are control flow GCC does not vectorize (checked with
    // -fopt-info-vec).
    const float sign0 = (c > 0.f ? 1.f : 0.f) - (c < 0.f ? 1.f : 0.f);
    const float sign = c != c ? c : sign0;
    float p0;
    if constexpr (kSplit) {
      p0 = load_split(w, low, i);
    } else {
      p0 = master[i];
    }
    const float p = p0 * keep - lr * sign;
    m[i] = mi + omb2 * (gi - mi);
    if constexpr (kSplit) {
      store_split(w, low, i, p);
    } else {
      master[i] = p;
      if constexpr (!std::is_same_v<W, void>) store(w, i, p);
    }
  }
}

template <typename G, typename W, bool kAccum, bool kSplit>
void adagrad_loop(const AdagradScalars& s, float* __restrict master, int16_t* __restrict low,
                  float* __restrict sum, const G* __restrict g, const float* __restrict acc,
                  W* __restrict w, std::size_t begin, std::size_t end) {
  const float scale = s.grad_scale, lr = s.lr, wd = s.weight_decay, eps = s.eps;
  // torch's order: g += wd p; sum += g * g; p += -clr * (g / (sqrt(sum) + eps)).
  for (std::size_t i = begin; i < end; ++i) {
    float p0;
    if constexpr (kSplit) {
      p0 = load_split(w, low, i);
    } else {
      p0 = master[i];
    }
    float gi = load(g, i);
    if constexpr (kAccum) gi += acc[i];
    gi = gi * scale + wd * p0;
    const float si = sum[i] + gi * gi;
    const float p = p0 - lr * (gi / (std::sqrt(si) + eps));
    sum[i] = si;
    if constexpr (kSplit) {
      store_split(w, low, i, p);
    } else {
      master[i] = p;
      if constexpr (!std::is_same_v<W, void>) store(w, i, p);
    }
  }
}

// Calls f.template operator()<kAccum, kSplit>() with the choices `a` makes (a split master
// only with a bf16 working copy).
template <typename W, typename F>
void with_layout(const ParamArrays& a, F&& f) {
  const bool accum = a.grad_accum != nullptr;
  if constexpr (std::is_same_v<W, Bf16>) {
    if (a.master_low != nullptr) {
      if (accum) return f.template operator()<true, true>();
      return f.template operator()<false, true>();
    }
  }
  if (accum) return f.template operator()<true, false>();
  f.template operator()<false, false>();
}

template <typename G, typename W>
void lion_typed(const LionScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  with_layout<W>(a, [&]<bool kAccum, bool kSplit>() {
    lion_loop<G, W, kAccum, kSplit>(s, a.master, a.master_low, a.exp_avg,
                                    static_cast<const G*>(a.grad), a.grad_accum,
                                    static_cast<W*>(a.weight), begin, end);
  });
}

template <typename G, typename W>
void adagrad_typed(const AdagradScalars& s, const ParamArrays& a, std::size_t begin,
                   std::size_t end) {
  with_layout<W>(a, [&]<bool kAccum, bool kSplit>() {
    adagrad_loop<G, W, kAccum, kSplit>(s, a.master, a.master_low, a.exp_avg_sq,
                                       static_cast<const G*>(a.grad), a.grad_accum,
                                       static_cast<W*>(a.weight), begin, end);
  });
}

template <typename G>
double sum_squares_typed(const ParamArrays& a, std::size_t begin, std::size_t end) {
  const G* __restrict g = static_cast<const G*>(a.grad);
  const float* __restrict acc = a.grad_accum;
  // Per-lane fp32 partial sums over short blocks (vectorizes without reassociating), added up
  // in double: accurate for billions of elements without a double-width inner loop. A block
  // whose fp32 squares overflow (finite grads above ~1.8e19, as a large loss scale makes them:
  // torch's GradScaler finds no inf there) is summed again in double, so the total is
  // infinite only where a grad is.
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
    float block = 0;
    for (float l : lanes) block += l;
    if (!std::isfinite(block)) {
      double wide = 0;
      for (std::size_t i = b; i < b + kBlock; ++i) {
        const double x = raw_grad(g, acc, i);
        wide += x * x;
      }
      total += wide;
      continue;
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

// The master as fp32 (master_get) and set from fp32 with its working copy (master_set), in any
// layout: split, separate (master and weight), or an fp32 weight that is its own master (passed
// as `master`, weight null).
template <typename W>
void master_get_typed(const ParamArrays& a, float* __restrict out, std::size_t begin,
                      std::size_t end) {
  const W* __restrict w = static_cast<const W*>(a.weight);
  if constexpr (std::is_same_v<W, Bf16>) {
    if (a.master_low != nullptr) {
      const int16_t* __restrict low = a.master_low;
      for (std::size_t i = begin; i < end; ++i) out[i] = load_split(w, low, i);
      return;
    }
  }
  const float* __restrict master = a.master;
  for (std::size_t i = begin; i < end; ++i) out[i] = master[i];
}

template <typename W>
void master_set_typed(const ParamArrays& a, const float* __restrict in, std::size_t begin,
                      std::size_t end) {
  W* __restrict w = static_cast<W*>(a.weight);
  if constexpr (std::is_same_v<W, Bf16>) {
    if (a.master_low != nullptr) {
      int16_t* __restrict low = a.master_low;
      for (std::size_t i = begin; i < end; ++i) store_split(w, low, i, in[i]);
      return;
    }
  }
  float* __restrict master = a.master;
  for (std::size_t i = begin; i < end; ++i) master[i] = in[i];
  if (w != nullptr) {
    for (std::size_t i = begin; i < end; ++i) store(w, i, in[i]);
  }
}

// Dtype dispatch: one branch per call (a parameter range), never per element: f<T>() with T
// the element type of `d` (fp32 for any other).
template <typename F>
decltype(auto) by_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kBF16:
      return f.template operator()<Bf16>();
    case DType::kF16:
      return f.template operator()<F16>();
    default:
      return f.template operator()<float>();
  }
}

void adamw(const AdamWScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtype(a.grad_dtype, [&]<typename G>() {
    if (a.weight == nullptr) return adamw_typed<G, void>(s, a, begin, end);
    by_dtype(a.weight_dtype, [&]<typename W>() { adamw_typed<G, W>(s, a, begin, end); });
  });
}
void sgd(const SgdScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtype(a.grad_dtype, [&]<typename G>() {
    if (a.weight == nullptr) return sgd_typed<G, void>(s, a, begin, end);
    by_dtype(a.weight_dtype, [&]<typename W>() { sgd_typed<G, W>(s, a, begin, end); });
  });
}
void lion(const LionScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtype(a.grad_dtype, [&]<typename G>() {
    if (a.weight == nullptr) return lion_typed<G, void>(s, a, begin, end);
    by_dtype(a.weight_dtype, [&]<typename W>() { lion_typed<G, W>(s, a, begin, end); });
  });
}
void adagrad(const AdagradScalars& s, const ParamArrays& a, std::size_t begin, std::size_t end) {
  by_dtype(a.grad_dtype, [&]<typename G>() {
    if (a.weight == nullptr) return adagrad_typed<G, void>(s, a, begin, end);
    by_dtype(a.weight_dtype, [&]<typename W>() { adagrad_typed<G, W>(s, a, begin, end); });
  });
}
double sum_squares(const ParamArrays& a, std::size_t begin, std::size_t end) {
  return by_dtype(a.grad_dtype, [&]<typename G>() { return sum_squares_typed<G>(a, begin, end); });
}
void accumulate(const ParamArrays& a, std::size_t begin, std::size_t end, bool first) {
  by_dtype(a.grad_dtype, [&]<typename G>() { accumulate_typed<G>(a, begin, end, first); });
}
// An fp32 weight that is its own master comes as `master` alone (weight null).
void master_get(const ParamArrays& a, float* out, std::size_t begin, std::size_t end) {
  by_dtype(a.weight == nullptr ? DType::kF32 : a.weight_dtype,
           [&]<typename W>() { master_get_typed<W>(a, out, begin, end); });
}
void master_set(const ParamArrays& a, const float* in, std::size_t begin, std::size_t end) {
  by_dtype(a.weight == nullptr ? DType::kF32 : a.weight_dtype,
           [&]<typename W>() { master_set_typed<W>(a, in, begin, end); });
}

}  // namespace

const KernelTable& table() {
  static const KernelTable t{STRATA_KERNEL_ISA, &adamw,      &sgd,        &lion,      &adagrad,
                             &sum_squares,      &accumulate, &master_get, &master_set};
  return t;
}

}  // namespace strata::optim::STRATA_KERNEL_NS
