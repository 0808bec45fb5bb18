// The optimizer kernels of the other kinds (runtime/optimizer/kernels_impl.h) against float64
// references of torch's formulas, on every instruction set this CPU runs, in each layout a
// param may have: Adam (L2 weight decay), Lion, Adagrad. AdamW, SGD and the shared parts are
// test_kernels.cpp.
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
// The layouts every new kernel is checked in: 0, an fp32 weight that is its own master and an
// fp32 grad; 1, a bf16 grad with an fp32 accumulator and a separate master written to a bf16
// working copy, the grad halved by grad_scale; 2, the same with a split master.
struct Layout {
  explicit Layout(int which, std::size_t n)
      : variant(which), master(n), weight(n), low(n, 0), grad_bf16(n), grad_f32(n), acc(n) {}
  int variant;
  std::vector<float> master;
  std::vector<uint16_t> weight;
  std::vector<int16_t> low;
  std::vector<uint16_t> grad_bf16;
  std::vector<float> grad_f32, acc;

  void set_master(const std::vector<double>& p) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      master[i] = static_cast<float>(p[i]);
      weight[i] = to_bf16(master[i]);
      low[i] = static_cast<int16_t>(std::bit_cast<uint32_t>(master[i]) -
                                    (static_cast<uint32_t>(weight[i]) << 16));
    }
  }
  float scale() const { return variant == 0 ? 1.f : 0.5f; }
  // Draws this step's grad; returns what the kernel will use, before grad_scale, in double.
  std::vector<double> draw(std::mt19937& rng) {
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<double> g(master.size());
    for (std::size_t i = 0; i < g.size(); ++i) {
      if (variant == 0) {
        grad_f32[i] = dist(rng);
        g[i] = grad_f32[i];
      } else {
        grad_bf16[i] = to_bf16(dist(rng));
        acc[i] = dist(rng);
        g[i] = static_cast<double>(from_bf16(grad_bf16[i]) + acc[i]);
      }
    }
    return g;
  }
  ParamArrays arrays(float* exp_avg, float* exp_avg_sq) {
    ParamArrays a;
    a.exp_avg = exp_avg;
    a.exp_avg_sq = exp_avg_sq;
    a.count = master.size();
    if (variant == 0) {
      a.master = master.data();
      a.grad = grad_f32.data();
      return a;
    }
    a.grad = grad_bf16.data();
    a.grad_dtype = DType::kBF16;
    a.grad_accum = acc.data();
    a.weight = weight.data();
    a.weight_dtype = DType::kBF16;
    if (variant == 2) {
      a.master_low = low.data();
    } else {
      a.master = master.data();
    }
    return a;
  }
  // The fp32 master, whatever the layout; the working copy must be it rounded.
  std::vector<float> read(const KernelTable& k) {
    std::vector<float> out(master.size());
    ParamArrays a = arrays(nullptr, nullptr);
    k.master_get(a, out.data(), 0, out.size());
    if (variant != 0) {
      for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(weight[i] == to_bf16(out[i]));
    }
    return out;
  }
};

std::vector<double> initial_params(std::size_t n) {
  std::mt19937 rng(5);
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> p(n);
  for (auto& x : p) x = static_cast<float>(dist(rng));
  return p;
}
}  // namespace

TEST_CASE("Adam (L2 weight decay) matches torch.optim.Adam", "[kernels]") {
  const std::size_t n = 4099;
  for (Isa isa : isas()) {
    for (int variant = 0; variant < 3; ++variant) {
      DYNAMIC_SECTION(isa_name(isa) << " layout " << variant) {
        const float lr = 1e-2f, b1 = 0.9f, b2 = 0.99f, eps = 1e-8f, wd = 0.05f;
        Layout l(variant, n);
        std::vector<double> rp = initial_params(n), rm(n, 0), rv(n, 0);
        l.set_master(rp);
        std::vector<float> m(n, 0.f), v(n, 0.f);
        std::mt19937 rng(7);
        for (int t = 1; t <= 10; ++t) {
          std::vector<double> g = l.draw(rng);
          AdamWScalars s;
          s.grad_scale = l.scale();
          s.beta1 = b1;
          s.beta2 = b2;
          s.eps = eps;
          s.lr_decay = 0.f;
          s.l2 = wd;
          s.step_size = static_cast<float>(lr / (1.0 - std::pow(double{b1}, t)));
          s.inv_bias2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{b2}, t)));
          const KernelTable& k = kernels(isa);
          k.adamw(s, l.arrays(m.data(), v.data()), 0, n / 2);
          k.adamw(s, l.arrays(m.data(), v.data()), n / 2, n);
          const double bc1 = 1.0 - std::pow(double{b1}, t), bc2 = 1.0 - std::pow(double{b2}, t);
          for (std::size_t i = 0; i < n; ++i) {
            const double gi = g[i] * l.scale() + wd * rp[i];
            rm[i] += (1.0 - b1) * (gi - rm[i]);
            rv[i] = rv[i] * b2 + (1.0 - b2) * gi * gi;
            rp[i] -= lr / bc1 * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + eps);
          }
        }
        require_close(l.read(kernels(isa)), rp, 1e-6, "param");
        require_close(m, rm, 1e-6, "exp_avg");
        require_close(v, rv, 1e-6, "exp_avg_sq");
      }
    }
  }
}

TEST_CASE("Lion matches the reference formula (Chen et al. 2023, lion-pytorch)", "[kernels]") {
  const std::size_t n = 4099;
  for (Isa isa : isas()) {
    for (int variant = 0; variant < 3; ++variant) {
      DYNAMIC_SECTION(isa_name(isa) << " layout " << variant) {
        const float lr = 1e-3f, b1 = 0.9f, b2 = 0.99f, wd = 0.1f;
        Layout l(variant, n);
        std::vector<double> rp = initial_params(n), rm(n, 0);
        l.set_master(rp);
        std::vector<float> m(n, 0.f);
        std::mt19937 rng(9);
        for (int t = 1; t <= 10; ++t) {
          std::vector<double> g = l.draw(rng);
          LionScalars s;
          s.grad_scale = l.scale();
          s.lr = lr;
          s.beta1 = b1;
          s.beta2 = b2;
          s.keep = static_cast<float>(1.0 - double{lr} * wd);
          kernels(isa).lion(s, l.arrays(m.data(), nullptr), 0, n / 3);
          kernels(isa).lion(s, l.arrays(m.data(), nullptr), n / 3, n);
          for (std::size_t i = 0; i < n; ++i) {
            const double gi = g[i] * l.scale();
            const double c = b1 * rm[i] + (1.0 - b1) * gi;
            rp[i] = rp[i] * (1.0 - double{lr} * wd) - lr * ((c > 0) - (c < 0));
            rm[i] = b2 * rm[i] + (1.0 - b2) * gi;
          }
        }
        require_close(l.read(kernels(isa)), rp, 1e-6, "param");
        require_close(m, rm, 1e-6, "exp_avg");
      }
    }
  }
  // sign(0) is 0: a zero grad on a zero moment leaves the weight to the decay alone, and a
  // NaN grad makes the weight NaN (not a step of -lr).
  for (Isa isa : isas()) {
    float p[2] = {1.f, 1.f}, m[2] = {0.f, 0.f};
    const float g[2] = {0.f, std::nanf("")};
    ParamArrays a;
    a.master = p;
    a.exp_avg = m;
    a.grad = g;
    a.count = 2;
    LionScalars s;
    s.lr = 0.1f;
    s.keep = 0.5f;
    kernels(isa).lion(s, a, 0, 2);
    REQUIRE(p[0] == 0.5f);
    REQUIRE(std::isnan(p[1]));
  }
}

TEST_CASE("Adagrad (L2 weight decay) matches torch.optim.Adagrad", "[kernels]") {
  const std::size_t n = 4099;
  for (Isa isa : isas()) {
    for (int variant = 0; variant < 3; ++variant) {
      DYNAMIC_SECTION(isa_name(isa) << " layout " << variant) {
        const float lr = 1e-2f, eps = 1e-10f, wd = 0.01f, init = 0.1f;
        Layout l(variant, n);
        std::vector<double> rp = initial_params(n), rs(n, init);
        l.set_master(rp);
        std::vector<float> sum(n, init);
        std::mt19937 rng(13);
        for (int t = 1; t <= 10; ++t) {
          std::vector<double> g = l.draw(rng);
          AdagradScalars s;
          s.grad_scale = l.scale();
          s.lr = lr;
          s.weight_decay = wd;
          s.eps = eps;
          kernels(isa).adagrad(s, l.arrays(nullptr, sum.data()), 0, n / 2);
          kernels(isa).adagrad(s, l.arrays(nullptr, sum.data()), n / 2, n);
          for (std::size_t i = 0; i < n; ++i) {
            const double gi = g[i] * l.scale() + wd * rp[i];
            rs[i] += gi * gi;
            rp[i] -= lr * gi / (std::sqrt(rs[i]) + eps);
          }
        }
        require_close(l.read(kernels(isa)), rp, 1e-6, "param");
        require_close(sum, rs, 1e-6, "sum");
      }
    }
  }
}
