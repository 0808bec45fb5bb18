#include <catch2/catch.hpp>

#include "runtime/memory/tensor_registry.h"

using namespace strata;

namespace {
TensorSpec spec(std::string name, std::vector<int64_t> shape, DType dtype = DType::kF32) {
  TensorSpec s;
  s.name = std::move(name);
  s.shape = std::move(shape);
  s.dtype = dtype;
  return s;
}
}  // namespace

TEST_CASE("registry finds tensors by id and name and never reuses ids", "[registry]") {
  TensorRegistry reg;
  TensorId a = 0, b = 0;
  REQUIRE(reg.add(spec("a", {2}), 8, Tier::kDram, 0, &a).is_ok());
  REQUIRE(reg.add(spec("b", {2}), 8, Tier::kHbm, 256, &b).is_ok());
  REQUIRE(a != b);
  REQUIRE(reg.find(a)->spec.name == "a");
  REQUIRE(reg.find("b")->id == b);
  REQUIRE(reg.find("missing") == nullptr);
  REQUIRE(reg.remove(a).is_ok());
  REQUIRE(reg.find(a) == nullptr);
  REQUIRE(reg.find("a") == nullptr);
  REQUIRE(reg.remove(a).code() == Code::kNotFound);
  TensorId again = 0;
  REQUIRE(reg.add(spec("a", {2}), 8, Tier::kDram, 0, &again).is_ok());
  REQUIRE(again != a);  // a stale handle cannot alias the new tensor
  REQUIRE(reg.size() == 2);
}

TEST_CASE("registry rejects duplicate names", "[registry]") {
  TensorRegistry reg;
  TensorId id = 0;
  REQUIRE(reg.add(spec("w", {1}), 4, Tier::kDram, 0, &id).is_ok());
  const Status s = reg.add(spec("w", {1}), 4, Tier::kDram, 256, &id);
  REQUIRE(s.code() == Code::kAlreadyExists);
  REQUIRE_THAT(s.message(), Catch::Contains("'w'"));
}

TEST_CASE("spec validation computes sizes and names what is wrong", "[registry]") {
  uint64_t n = 0;
  REQUIRE(validate_spec(spec("x", {3, 4}, DType::kBF16), &n).is_ok());
  REQUIRE(n == 24);
  REQUIRE(validate_spec(spec("scalar", {}, DType::kF64), &n).is_ok());
  REQUIRE(n == 8);
  REQUIRE(validate_spec(spec("empty", {0, 5}), &n).is_ok());
  REQUIRE(n == 0);

  Status s = validate_spec(spec("", {1}), &n);
  REQUIRE(s.code() == Code::kInvalidArgument);
  s = validate_spec(spec(std::string(256, 'x'), {1}), &n);
  REQUIRE_THAT(s.message(), Catch::Contains("longer than the limit"));
  s = validate_spec(spec("neg", {4, -1}), &n);
  REQUIRE_THAT(s.message(), Catch::Contains("dimension 1 is negative"));
  s = validate_spec(spec("big", {1ll << 40, 1ll << 40}), &n);
  REQUIRE_THAT(s.message(), Catch::Contains("overflows"));
  s = validate_spec(spec("dims", {1, 1, 1, 1, 1, 1, 1, 1, 1}), &n);
  REQUIRE_THAT(s.message(), Catch::Contains("9 dimensions"));
  TensorSpec bad = spec("dt", {1});
  bad.dtype = static_cast<DType>(99);
  REQUIRE_THAT(validate_spec(bad, &n).message(), Catch::Contains("unknown dtype 99"));
}
