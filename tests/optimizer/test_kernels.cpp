// The optimizer kernels on every instruction set this CPU has, against float64 references of
// PyTorch's formulas (torch.optim.AdamW and SGD, single-tensor code path): the updates, sums
// and accumulation, fp16 conversion, split masters. Adam, Lion and Adagrad are
// test_kernels_kinds.cpp.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "optimizer/kernel_checks.h"
#include "runtime/optimizer/half.h"
#include "runtime/optimizer/kernels.h"

using namespace strata;
using namespace strata::optim;
using namespace strata::optim::testing;

namespace {

struct Data {
  std::vector<float> master, m, v;
  std::vector<float> grad_f32;
  std::vector<uint16_t> grad_bf16, weight_bf16;
};

}  // namespace

TEST_CASE("AdamW matches a float64 PyTorch reference to 1e-6 relative", "[kernels]") {
  const std::size_t n = 10007;  // not a multiple of any vector width
  const float lr = 3e-3f, wd = 0.05f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  const int steps = 20;
  for (Isa isa : isas()) {
    for (bool bf16 : {false, true}) {
      DYNAMIC_SECTION(isa_name(isa) << (bf16 ? " bf16 grads and weights" : " fp32")) {
        std::mt19937 rng(7);
        std::normal_distribution<float> dist(0.f, 1.f);
        Data d;
        d.master.resize(n);
        for (auto& x : d.master) x = dist(rng);
        if (bf16) {
          // A bf16 model's master starts as its weights.
          for (auto& x : d.master) x = from_bf16(to_bf16(x));
          d.weight_bf16.resize(n);
        }
        d.m.assign(n, 0.f);
        d.v.assign(n, 0.f);
        std::vector<double> rp(d.master.begin(), d.master.end()), rm(n, 0), rv(n, 0);
        const KernelTable& k = kernels(isa);
        for (int t = 1; t <= steps; ++t) {
          // Grads of mixed magnitudes, some exactly zero.
          std::vector<double> g(n);
          d.grad_f32.resize(n);
          d.grad_bf16.resize(n);
          for (std::size_t i = 0; i < n; ++i) {
            float x = dist(rng) * (i % 3 == 0 ? 1e-3f : 1.f);
            if (i % 101 == 0) x = 0.f;
            if (bf16) {
              d.grad_bf16[i] = to_bf16(x);
              g[i] = from_bf16(d.grad_bf16[i]);
            } else {
              d.grad_f32[i] = x;
              g[i] = x;
            }
          }
          ParamArrays a;
          a.master = d.master.data();
          a.exp_avg = d.m.data();
          a.exp_avg_sq = d.v.data();
          a.grad = bf16 ? static_cast<const void*>(d.grad_bf16.data()) : d.grad_f32.data();
          a.grad_dtype = bf16 ? DType::kBF16 : DType::kF32;
          a.weight = bf16 ? d.weight_bf16.data() : nullptr;
          a.weight_dtype = DType::kBF16;
          a.count = n;
          AdamWScalars s;
          s.beta1 = b1;
          s.beta2 = b2;
          s.eps = eps;
          s.lr_decay = static_cast<float>(double{lr} * wd);
          s.step_size = static_cast<float>(lr / (1.0 - std::pow(double{b1}, t)));
          s.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{b2}, t)));
          // Two ranges, as the thread pool splits a parameter.
          k.adamw(s, a, 0, n / 3);
          k.adamw(s, a, n / 3, n);
          const double bc1 = 1.0 - std::pow(double{b1}, t), bc2 = 1.0 - std::pow(double{b2}, t);
          for (std::size_t i = 0; i < n; ++i) {
            rp[i] *= 1.0 - double{lr} * wd;
            rm[i] += (1.0 - b1) * (g[i] - rm[i]);
            rv[i] = rv[i] * b2 + (1.0 - b2) * g[i] * g[i];
            const double denom = std::sqrt(rv[i]) / std::sqrt(bc2) + eps;
            rp[i] -= lr / bc1 * rm[i] / denom;
          }
        }
        require_close(d.master, rp, 1e-6, "master");
        require_close(d.m, rm, 1e-6, "exp_avg");
        require_close(d.v, rv, 1e-6, "exp_avg_sq");
        if (bf16) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(d.weight_bf16[i] == to_bf16(d.master[i]));
        }
      }
    }
  }
}

TEST_CASE("SGD with momentum, dampening, nesterov and L2 decay matches PyTorch", "[kernels]") {
  const std::size_t n = 4099;
  for (Isa isa : isas()) {
    for (int variant = 0; variant < 3; ++variant) {
      DYNAMIC_SECTION(isa_name(isa) << " variant " << variant) {
        const float lr = 0.01f, wd = 1e-3f, mom = variant == 0 ? 0.f : 0.9f;
        const float damp = variant == 1 ? 0.1f : 0.f;
        const bool nesterov = variant == 2;
        std::mt19937 rng(11);
        std::normal_distribution<float> dist(0.f, 1.f);
        std::vector<float> p(n), buf(n, 0.f), g(n);
        for (auto& x : p) x = dist(rng);
        std::vector<double> rp(p.begin(), p.end()), rb(n, 0);
        for (int t = 1; t <= 10; ++t) {
          for (auto& x : g) x = dist(rng);
          ParamArrays a;
          a.master = p.data();
          a.exp_avg = mom > 0 ? buf.data() : nullptr;
          a.grad = g.data();
          a.count = n;
          SgdScalars s;
          s.lr = lr;
          s.weight_decay = wd;
          s.momentum = mom;
          s.dampening = damp;
          s.nesterov = nesterov;
          s.first_step = t == 1;
          kernels(isa).sgd(s, a, 0, n);
          for (std::size_t i = 0; i < n; ++i) {
            double d = g[i] + double{wd} * rp[i];
            if (mom > 0) {
              rb[i] = t == 1 ? d : mom * rb[i] + (1.0 - damp) * d;
              d = nesterov ? d + mom * rb[i] : rb[i];
            }
            rp[i] -= lr * d;
          }
        }
        require_close(p, rp, 1e-6, "param");
      }
    }
  }
}

TEST_CASE("sum of squares and accumulation, with and without an accumulator", "[kernels]") {
  const std::size_t n = 100003;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> g(n), acc(n);
  for (auto& x : g) x = dist(rng);
  double ref = 0;
  for (float x : g) ref += double{x} * x;
  for (Isa isa : isas()) {
    const KernelTable& k = kernels(isa);
    ParamArrays a;
    a.grad = g.data();
    a.count = n;
    const double ss = k.sum_squares(a, 0, 5000) + k.sum_squares(a, 5000, n);
    REQUIRE(std::abs(ss - ref) <= 1e-6 * ref);
    a.grad_accum = acc.data();
    k.accumulate(a, 0, n, true);
    k.accumulate(a, 0, n, false);  // acc = 2 g
    for (std::size_t i = 0; i < n; ++i) REQUIRE(acc[i] == 2 * g[i]);
    // (g + acc)^2 = 9 g^2
    REQUIRE(std::abs(k.sum_squares(a, 0, n) - 9 * ref) <= 1e-6 * 9 * ref);
    g[17] = INFINITY;
    REQUIRE(!std::isfinite(k.sum_squares(a, 0, n)));
    // Finite grads whose fp32 squares overflow (a large loss scale): the sum is finite, as
    // torch's GradScaler sees them, and right in double.
    a.grad_accum = nullptr;
    g[17] = 0x1p70f;
    g[n - 3] = -0x1p66f;  // in the tail past the last whole block
    const double big = k.sum_squares(a, 0, n);
    REQUIRE(std::isfinite(big));
    REQUIRE(std::abs(big - (0x1p140 + 0x1p132)) <= 1e-6 * big);
    a.grad_accum = acc.data();
    g[n - 3] = 0.f;
    g[17] = 0.f;
    ref -= 0;  // (g[17] changed: recompute below for the next ISA)
    ref = 0;
    for (float x : g) ref += double{x} * x;
  }
}

// half.h is what the kernels use for fp16 where the compiler has no _Float16 (clang < 15 on
// x86); it must be bit for bit the hardware's conversion (checked against _Float16, which
// GCC converts in IEEE round-to-nearest-even).
TEST_CASE("half.h converts fp16 exactly as _Float16 does", "[kernels]") {
  for (uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<uint16_t>(b);
    _Float16 ref;
    std::memcpy(&ref, &h, sizeof ref);
    const float want = static_cast<float>(ref), got = half_to_float(h);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
      REQUIRE(half_from_float(got) == (h | 0x0200u));  // quieted, payload kept
    } else {
      REQUIRE(std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want));
      REQUIRE(half_from_float(got) == h);
    }
  }
  // Every float in a stride that visits all exponents and low mantissa bits, plus the ties and
  // the edges: overflow to inf at 65520, the subnormal range, 2^-25 rounding to zero.
  std::vector<uint32_t> bits;
  for (uint64_t u = 0; u < (1ull << 32); u += 4093) bits.push_back(static_cast<uint32_t>(u));
  for (float f : {65504.f, 65519.f, 65520.f, 0x1p-14f, 0x1p-24f, 0x1p-25f, 0x1.000002p-25f,
                  0x1.8p-24f, 0x1.4p-24f, 1.f + 0x1p-11f, 1.f + 0x3p-11f}) {
    bits.push_back(std::bit_cast<uint32_t>(f));
    bits.push_back(std::bit_cast<uint32_t>(-f));
  }
  for (uint32_t u : bits) {
    const float f = std::bit_cast<float>(u);
    if (std::isnan(f)) continue;
    const auto ref = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &ref, sizeof want);
    INFO("float bits " << u);
    REQUIRE(half_from_float(f) == want);
  }
}

namespace {

// What a split master gives back for x (its bits u): x itself, but for a NaN (a NaN) and a
// value exactly halfway between two bf16 values that rounded down to the even one (one ulp
// nearer it: kernels_impl.h's store_split).
bool split_keeps(uint32_t u, uint32_t got) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (got & 0x7FFFFFFFu) > 0x7F800000u;
  const bool tie_down = (u & 0xFFFFu) == 0x8000u && ((u >> 16) & 1u) == 0;
  return got == (tie_down ? u - 1 : u);
}

}  // namespace

TEST_CASE("a split master: the bf16 weight rounds as torch, the master comes back whole",
          "[kernels]") {
  // Every special case, then a sweep: all 2^16 upper halves with lower halves around the
  // rounding boundary, and random bits.
  std::vector<uint32_t> bits = {0u,          0x80000000u, 1u,          0x80000001u, 0x00008000u,
                                0x00018000u, 0x3F808000u, 0x3F818000u, 0xBF808000u, 0x7F7FFFFFu,
                                0xFF7FFFFFu, 0x7F7F8000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                0x7F800001u, 0xFFFF0001u, 0x7FFFFFFFu};
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) bits.push_back(hi << 16 | lo);
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) bits.push_back(static_cast<uint32_t>(rng()));
  const std::size_t n = bits.size();
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = std::bit_cast<float>(bits[i]);
  for (Isa isa : isas()) {
    DYNAMIC_SECTION(isa_name(isa)) {
      const KernelTable& k = kernels(isa);
      std::vector<uint16_t> w_split(n), w_sep(n);
      std::vector<int16_t> low(n);
      std::vector<float> master(n), back(n);
      ParamArrays split;
      split.weight = w_split.data();
      split.weight_dtype = DType::kBF16;
      split.master_low = low.data();
      split.count = n;
      ParamArrays separate;
      separate.weight = w_sep.data();
      separate.weight_dtype = DType::kBF16;
      separate.master = master.data();
      separate.count = n;
      k.master_set(split, x.data(), 0, n);
      k.master_set(separate, x.data(), 0, n);
      k.master_get(split, back.data(), 0, n);
      std::size_t nudged = 0;
      for (std::size_t i = 0; i < n; ++i) {
        INFO("bits " << std::hex << bits[i]);
        REQUIRE(w_split[i] == w_sep[i]);  // the weight: torch's rounding, in both layouts
        const uint32_t got = std::bit_cast<uint32_t>(back[i]);
        REQUIRE(split_keeps(bits[i], got));
        if ((bits[i] & 0x7FFFFFFFu) <= 0x7F800000u) {
          REQUIRE(w_split[i] == to_bf16(x[i]));  // and the master still rounds to the weight
          REQUIRE(to_bf16(back[i]) == w_split[i]);
          nudged += got != bits[i];
        }
      }
      REQUIRE(nudged > 0);  // the halfway cases were there
      // A weight written alone (the rests stay): the master put together still rounds to the
      // new weight (the old rest where it fits, else the weight itself), never a NaN from a
      // rest that wraps (0 with a negative rest, the case that made one).
      std::vector<uint16_t> fresh(n);
      for (std::size_t i = 0; i < n; ++i) {
        fresh[i] = static_cast<uint16_t>(i % 7 == 0 ? 0 : i % 7 == 1 ? 0x8000 : rng());
      }
      w_split = fresh;
      k.master_get(split, back.data(), 0, n);
      for (std::size_t i = 0; i < n; ++i) {
        INFO("weight " << std::hex << fresh[i] << " rest " << low[i]);
        const uint32_t upper = static_cast<uint32_t>(fresh[i]) << 16;
        if ((upper & 0x7FFFFFFFu) > 0x7F800000u) continue;  // a NaN weight: a NaN master
        REQUIRE(to_bf16(back[i]) == fresh[i]);
        const uint32_t got = std::bit_cast<uint32_t>(back[i]);
        const uint32_t with_rest = upper + static_cast<uint32_t>(static_cast<int32_t>(low[i]));
        REQUIRE((got == with_rest || got == upper));
      }
    }
  }
}

TEST_CASE("AdamW and SGD on a split master write what they write on a separate one", "[kernels]") {
  const std::size_t n = 100003;
  for (Isa isa : isas()) {
    for (bool sgd : {false, true}) {
      DYNAMIC_SECTION(isa_name(isa) << (sgd ? " SGD with momentum" : " AdamW")) {
        const KernelTable& k = kernels(isa);
        std::mt19937 rng(5);
        std::normal_distribution<float> dist(0.f, 1.f);
        std::vector<float> master(n), start(n);
        std::vector<uint16_t> w_sep(n), w_split(n), grad(n);
        std::vector<int16_t> low(n);
        for (auto& v : start) v = dist(rng);
        for (auto& g : grad) g = to_bf16(dist(rng));
        ParamArrays split, separate;
        split.weight = w_split.data();
        split.master_low = low.data();
        separate.weight = w_sep.data();
        separate.master = master.data();
        std::vector<float> m1(n, 0.1f), v1(n, 0.2f), m2(m1), v2(v1);
        for (ParamArrays* a : {&split, &separate}) {
          a->weight_dtype = DType::kBF16;
          a->grad = grad.data();
          a->grad_dtype = DType::kBF16;
          a->count = n;
          k.master_set(*a, start.data(), 0, n);
        }
        split.exp_avg = m1.data();
        split.exp_avg_sq = v1.data();
        separate.exp_avg = m2.data();
        separate.exp_avg_sq = v2.data();
        // The same starting master in both (the split one may hold a nudged halfway value).
        std::vector<float> from(n);
        k.master_get(split, from.data(), 0, n);
        k.master_set(separate, from.data(), 0, n);
        if (sgd) {
          SgdScalars s;
          s.lr = 1e-2f;
          s.weight_decay = 1e-3f;
          s.momentum = 0.9f;
          k.sgd(s, split, 0, n);
          k.sgd(s, separate, 0, n);
        } else {
          AdamWScalars s;
          s.lr_decay = 1e-4f;
          s.step_size = 1e-2f;
          s.inv_bias2_sqrt = 30.f;
          k.adamw(s, split, 0, n / 2);
          k.adamw(s, split, n / 2, n);
          k.adamw(s, separate, 0, n);
        }
        std::vector<float> got(n);
        k.master_get(split, got.data(), 0, n);
        for (std::size_t i = 0; i < n; ++i) {
          INFO(i);
          REQUIRE(w_split[i] == w_sep[i]);
          REQUIRE(split_keeps(std::bit_cast<uint32_t>(master[i]), std::bit_cast<uint32_t>(got[i])));
        }
        REQUIRE(m1 == m2);
        REQUIRE(v1 == v2);
      }
    }
  }
}
