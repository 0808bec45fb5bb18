// The placement's step model and its choice of homes (runtime/placement/placement.h), on
// declared sizes and given rates: no runtime, no measurement.
#include <catch2/catch.hpp>

#include <limits>

#include "runtime/placement/placement.h"

using Catch::Detail::Approx;
using namespace strata;

namespace {

PlacementLayer layer(uint64_t weight, uint64_t state, double fwd = 0, double bwd = 0) {
  PlacementLayer l;
  l.weight_bytes = weight;
  l.grad_bytes = weight;
  l.state_bytes = state;
  l.update_elements = weight / 2;
  l.forward_seconds = fwd;
  l.backward_seconds = bwd;
  return l;
}

std::vector<LayerHome> all_dram(std::size_t n) {
  return std::vector<LayerHome>(n);
}

}  // namespace

TEST_CASE("placement: the step is the compute plus what the next forward waits for") {
  // Two layers, 1 s forward and 2 s backward each; each update 1 s on the CPU, after the whole
  // backward pass. Layer 0's next forward waits for its update (1 s); layer 1's update ends
  // while layer 0 computes. Links and disk not counted.
  PlacementRequest r;
  r.layers = {layer(2000, 6000, 1, 2), layer(2000, 6000, 1, 2)};
  r.rates.update_elements = 1000;  // 1000 elements per layer: 1 s
  const StepPrediction p = predict_step(r, all_dram(2), 0);
  CHECK(p.step_seconds == Approx(7.0));
  CHECK(p.compute == Approx(6.0));
  CHECK(p.update == Approx(2.0));
  CHECK(p.gpu_wait == Approx(1.0));
  CHECK(p.bottleneck == "compute");
  // Updates as grads land instead: layer 1's runs during layer 0's backward, layer 0's after
  // it; the next forward still waits for layer 0's.
  r.updates_after_backward = false;
  CHECK(predict_step(r, all_dram(2), 0).step_seconds == Approx(7.0));
}

TEST_CASE("placement: PCIe loads hide behind compute until they are the longer") {
  PlacementRequest r;
  for (int i = 0; i < 8; ++i) r.layers.push_back(layer(1000, 0, 1, 1));
  r.rates.h2d = 10000;  // 0.1 s a load
  r.prefetch_depth = 2;
  const StepPrediction fast = predict_step(r, all_dram(8), 0);
  CHECK(fast.step_seconds == Approx(16.0).margin(0.2));
  CHECK(fast.h2d == Approx(1.6));
  r.rates.h2d = 250;  // 4 s a load: h2d-bound, 16 loads a step
  const StepPrediction slow = predict_step(r, all_dram(8), 0);
  CHECK(slow.step_seconds == Approx(64.0).margin(1.0));
  CHECK(slow.bottleneck == "h2d");
}

TEST_CASE("placement: state on NVMe costs its reads and writes, overlapped as measured") {
  PlacementRequest r;
  for (int i = 0; i < 4; ++i) r.layers.push_back(layer(1000, 6000));
  r.rates.nvme_read = 6000;   // 1 s to read a layer's state
  r.rates.nvme_write = 3000;  // 2 s to write it
  std::vector<LayerHome> homes(4, LayerHome{false, true});
  const StepPrediction serial = predict_step(r, homes, 4);
  CHECK(serial.nvme_read == Approx(4.0));
  CHECK(serial.nvme_write == Approx(8.0));
  CHECK(serial.step_seconds == Approx(12.0).margin(0.01));
  CHECK(serial.bottleneck == "nvme");
  // The disk overlapping reads with writes fully: at equal rates, half the time.
  r.rates.nvme_write = 6000;
  CHECK(predict_step(r, homes, 4).step_seconds == Approx(8.0).margin(0.01));
  r.rates.nvme_mixed = 0.5;
  CHECK(predict_step(r, homes, 4).step_seconds == Approx(4.0).margin(0.01));
  r.rates.nvme_write = 3000;
  // One slot: each read waits for the previous layer's write-back, still disk-bound.
  r.rates.nvme_mixed = 1;
  CHECK(predict_step(r, homes, 1).step_seconds >= serial.step_seconds - 1e-9);
}

TEST_CASE("placement: DRAM first, the last layers' state spills, then slots are weighed") {
  PlacementRequest r;
  for (int i = 0; i < 6; ++i) r.layers.push_back(layer(1000, 6000, 1, 2));
  r.rates = {1e6, 1e6, 6000, 6000, 1, 3000};
  // Everything in DRAM needs 6 * (1000 + 1000 + 6000) = 48000.
  r.dram_budget = 48000;
  r.nvme_budget = 1 << 20;
  Placement all;
  REQUIRE(choose_placement(r, &all).is_ok());
  CHECK(all.staging_slots == 0);
  CHECK(all.nvme_bytes == 0);
  for (const LayerHome& h : all.homes) CHECK_FALSE((h.state_on_nvme || h.weights_on_nvme));

  // 8000 short: with a slot (6000) to stage through, three layers' state must go out.
  r.dram_budget = 40000;
  Placement some;
  REQUIRE(choose_placement(r, &some).is_ok());
  CHECK(some.dram_bytes <= r.dram_budget);
  CHECK(some.staging_slots >= 1);
  std::size_t spilled = 0;
  for (const LayerHome& h : some.homes) spilled += h.state_on_nvme;
  CHECK(spilled == 3);
  for (std::size_t i = 0; i < some.homes.size(); ++i)  // the last layers
    CHECK(some.homes[i].state_on_nvme == (i >= some.homes.size() - spilled));
  // The DRAM left over keeps part of the first spilled layer's state (as the optimizer's
  // PLANNED placement will), and the prediction stages only the rest.
  const uint64_t slots_bytes = uint64_t{some.staging_slots} * some.slot_bytes;
  const uint64_t left = r.dram_budget - (48000 - 3 * 6000 + slots_bytes);
  CHECK(left > 0);
  CHECK(some.homes[3].state_in_dram == left);
  CHECK(some.homes[4].state_in_dram == 0);
  CHECK(some.nvme_bytes == 3 * 6000 - left);
  CHECK(some.dram_bytes == r.dram_budget);
  CHECK(some.prediction.nvme_read == Approx((3 * 6000.0 - left) / 6000));
  // No fixed slot count does better than the free choice.
  for (uint32_t slots = 1; slots <= 4; ++slots) {
    PlacementRequest fixed = r;
    fixed.staging_slots = slots;
    Placement p;
    if (choose_placement(fixed, &p).is_ok())
      CHECK(some.prediction.step_seconds <= p.prediction.step_seconds * 1.01);
  }
  CHECK(some.prediction.step_seconds >= all.prediction.step_seconds);
}

TEST_CASE("placement: a faster disk never predicts a slower step") {
  PlacementRequest r;
  for (int i = 0; i < 5; ++i) r.layers.push_back(layer(1000, 6000, 0.5, 1));
  r.rates = {1e5, 1e5, 2000, 2000, 1, 4000};
  r.dram_budget = 30000;
  r.nvme_budget = 1 << 20;
  double previous = 1e300;
  for (double rate : {1000.0, 2000.0, 4000.0, 8000.0, 64000.0}) {
    r.rates.nvme_read = r.rates.nvme_write = rate;
    Placement p;
    REQUIRE(choose_placement(r, &p).is_ok());
    CHECK(p.prediction.step_seconds <= previous * (1 + 1e-9));
    previous = p.prediction.step_seconds;
  }
}

TEST_CASE("placement: frozen layers and fixed homes") {
  PlacementRequest r;
  r.layers = {layer(1000, 0, 1, 1), layer(1000, 6000, 1, 1), layer(1000, 6000, 1, 1)};
  r.layers[1].state_tier = 2;  // fixed on NVMe
  r.rates = {1e6, 1e6, 6000, 6000, 1, 1e6};
  r.dram_budget = 1 << 20;
  r.nvme_budget = 1 << 20;
  Placement p;
  REQUIRE(choose_placement(r, &p).is_ok());
  CHECK_FALSE(p.homes[0].state_on_nvme);  // frozen: nothing to place
  CHECK(p.homes[1].state_on_nvme);
  CHECK_FALSE(p.homes[2].state_on_nvme);  // DRAM has room
  CHECK(p.staging_slots >= 1);
  CHECK(p.slot_bytes == 6000);
}

TEST_CASE("placement: grads in HBM take one fetch buffer of DRAM, and every read crosses PCIe") {
  // Two layers; a grad copy takes 1 s on the D2H link, an update 1 s on the CPU.
  PlacementRequest r;
  r.layers = {layer(1000, 6000, 1, 2), layer(1000, 6000, 1, 2)};
  r.rates = {1e9, 1000, 0, 0, 1, 500};
  r.dram_budget = 15000;  // weights and state (14000) and one layer's grads
  Placement dram;
  const Status refused = choose_placement(r, &dram);
  CHECK(refused.code() == Code::kOutOfMemory);  // every grad in DRAM needs 16000
  CHECK_THAT(refused.message(), Catch::Contains("16000") && Catch::Contains("the grads in DRAM"));

  for (PlacementLayer& l : r.layers) l.grad_tier = kGradsInHbm;
  Placement hbm;
  REQUIRE(choose_placement(r, &hbm).is_ok());
  CHECK(hbm.grad_fetch_bytes == 1000);
  CHECK(hbm.dram_bytes == 15000);
  CHECK(hbm.grads_in_hbm == std::vector<bool>{true, true});
  CHECK_THAT(placement_to_text(hbm),
             Catch::Contains("grads hbm") && Catch::Contains("grads in HBM read through"));
  CHECK_THAT(placement_to_json(hbm), Catch::Contains("\"grad_fetch_bytes\": 1000") &&
                                         Catch::Contains("\"grads\": \"hbm\""));

  // The copies: with the update after the whole backward pass (clipping, an explicit step),
  // each layer's grads are read twice a step (the norm or landing, then the update); as grads
  // land, once. Grads in DRAM: once, by the backward pass.
  const StepPrediction twice = predict_step(r, all_dram(2), 0);
  CHECK(twice.d2h == Approx(4.0));
  CHECK(twice.update == Approx(2.0));
  r.updates_after_backward = false;
  CHECK(predict_step(r, all_dram(2), 0).d2h == Approx(2.0));
  r.updates_after_backward = true;
  // An update lasts as long as its grads take to arrive, when that is the longer.
  r.rates.d2h = 250;  // 4 s a copy
  CHECK(predict_step(r, all_dram(2), 0).update == Approx(8.0));
  PlacementRequest in_dram = r;
  for (PlacementLayer& l : in_dram.layers) l.grad_tier = kGradsInDram;
  const StepPrediction dram_grads = predict_step(in_dram, all_dram(2), 0);
  CHECK(dram_grads.d2h == Approx(8.0));
  CHECK(dram_grads.update == Approx(2.0));

  // Updates as grads land: with fast copies grads in HBM overlap the backward pass as grads in
  // DRAM do. (With the fetch buffer's users chained in forward order, the last layer's update
  // waited for layer 0's, after the whole pass.)
  PlacementRequest deep;
  for (int i = 0; i < 8; ++i) deep.layers.push_back(layer(1000, 6000, 0.1, 0.2));
  deep.rates = {1e9, 1e9, 0, 0, 1, 1000};  // 0.5 s an update, copies all but free
  deep.updates_after_backward = false;
  const double as_grads_land = predict_step(deep, all_dram(8), 0).step_seconds;
  for (PlacementLayer& l : deep.layers) l.grad_tier = kGradsInHbm;
  CHECK(predict_step(deep, all_dram(8), 0).step_seconds == Approx(as_grads_land).margin(1e-3));
  deep.updates_after_backward = true;
  CHECK(predict_step(deep, all_dram(8), 0).step_seconds > as_grads_land + 0.1);

  r.layers[1].grad_tier = 2;  // NVMe is not a grad tier
  Placement bad;
  const Status s = choose_placement(r, &bad);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Contains("grad tier 2"));
}

TEST_CASE("placement: refusals name the problem") {
  PlacementRequest r;
  Placement none;
  CHECK(choose_placement(r, &none).code() == Code::kInvalidArgument);  // no layers
  r.layers = {layer(1000, 6000), layer(1000, 6000)};
  r.dram_budget = 1 << 20;
  Placement p;
  r.layers[0].weight_tier = 5;
  Status s = choose_placement(r, &p);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("weight tier 5") != std::string::npos);
  r.layers[0].weight_tier = -1;
  r.rates.nvme_mixed = 0.2;
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.rates.nvme_mixed = 1;
  r.rates.h2d = std::numeric_limits<double>::quiet_NaN();
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.rates.h2d = 0;
  r.dram_budget = 10000;  // all in DRAM needs 16000, and there is no NVMe
  s = choose_placement(r, &p);
  CHECK(s.code() == Code::kOutOfMemory);
  CHECK(s.message().find("DRAM needs at least 16000") != std::string::npos);
  CHECK(s.message().find("an NVMe budget") != std::string::npos);
  r.nvme_budget = 1 << 20;  // now state spills: 2 grads + 2 weights + 1 slot = 10000
  REQUIRE(choose_placement(r, &p).is_ok());
  CHECK(p.dram_bytes == 10000);
  CHECK(p.homes[0].state_on_nvme);
  CHECK(p.homes[1].state_on_nvme);
}

TEST_CASE("placement: the dumps name every run of layers and the prediction") {
  PlacementRequest r;
  for (int i = 0; i < 4; ++i) r.layers.push_back(layer(1000, 6000, 1, 2));
  r.layers[0].name = "blocks.0";
  r.rates = {1e6, 1e6, 6000, 6000, 0.8, 3000};
  r.dram_budget = 26000;
  r.nvme_budget = 1 << 20;
  Placement p;
  REQUIRE(choose_placement(r, &p).is_ok());
  const std::string text = placement_to_text(p);
  CHECK(text.find("predicted step") != std::string::npos);
  CHECK(text.find("blocks.0") != std::string::npos);
  CHECK(text.find("state nvme") != std::string::npos);
  const std::string json = placement_to_json(p);
  CHECK(json.find("\"bottleneck\"") != std::string::npos);
  CHECK(json.find("\"nvme_mixed\": 0.8") != std::string::npos);
}

TEST_CASE("placement: hostile sizes are refused, a deep model is planned") {
  PlacementRequest r;
  r.layers = {layer(1000, 6000), layer(1000, 6000)};
  r.dram_budget = 1 << 20;
  Placement p;
  r.layers[1].state_bytes = UINT64_MAX;  // would wrap every sum
  Status s = choose_placement(r, &p);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("above the") != std::string::npos);
  r.layers.assign(kMaxPlacementLayers + 1, layer(1000, 6000));
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  // Rates and times that would make simulated times infinite.
  r.layers.assign(2, layer(1000, 6000));
  r.rates.nvme_read = 1e-300;
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.rates.nvme_read = 0;
  r.layers[0].backward_seconds = 1e300;
  s = choose_placement(r, &p);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("at most") != std::string::npos);
  // 2000 layers with state spilling: the search and each simulation stay near-linear (a
  // quadratic scheduler took minutes here), and the choice is a suffix that fits.
  r.layers.assign(2000, layer(1000, 6000, 0.01, 0.02));
  r.rates = {1e6, 1e6, 6e5, 6e5, 0.9, 1e6};
  r.dram_budget = 2000 * 8000 - 300 * 6000;
  r.nvme_budget = 1ull << 40;
  REQUIRE(choose_placement(r, &p).is_ok());
  CHECK(p.dram_bytes <= r.dram_budget);
  CHECK(p.homes.back().state_on_nvme);
  CHECK_FALSE(p.homes.front().state_on_nvme);
  CHECK(p.prediction.step_seconds > 0);
}

TEST_CASE("placement: review regressions (bounds, a fit behind an NVMe overflow, staged bytes)") {
  PlacementRequest r;
  r.layers = {layer(1000, 6000), layer(1000, 6000)};
  r.dram_budget = 1 << 20;
  Placement p;
  r.prefetch_depth = UINT32_MAX;  // depth + 1 wrapped to 0 and indexed out of bounds
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.prefetch_depth = 1;
  r.max_staging_slots = 5;  // looped 4 billion times at UINT32_MAX
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.max_staging_slots = 4;
  r.layers[0].grad_bytes = kMaxLayerBytes + 1;  // 16384 of these wrapped the DRAM sum to 0
  CHECK(choose_placement(r, &p).code() == Code::kInvalidArgument);
  r.layers[0].grad_bytes = 1000;
  r.layers[1].weight_tier = 2;  // fixed on NVMe without an NVMe budget
  Status s = choose_placement(r, &p);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK(s.message().find("NVMe budget is 0") != std::string::npos);

  // No weights out: state must all go (NVMe 85 > 70). One layer's weights out: two layers'
  // state suffices (DRAM 82, NVMe 65; 3 of the state then stay in the DRAM left over). The
  // search once stopped at the first NVMe overflow.
  PlacementRequest q;
  q.layers = {layer(1, 30), layer(1, 50), layer(10, 5)};
  for (auto& l : q.layers) l.grad_bytes = 0;
  q.staging_slots = 1;
  q.dram_budget = 85;
  q.nvme_budget = 70;
  REQUIRE(choose_placement(q, &p).is_ok());
  CHECK(p.homes[2].weights_on_nvme);
  CHECK(p.nvme_bytes == 62);
  CHECK(p.dram_bytes == 85);
  q.nvme_budget = 60;  // now nothing fits, and the message says NVMe is what is short
  s = choose_placement(q, &p);
  CHECK(s.code() == Code::kOutOfMemory);
  CHECK(s.message().find("NVMe needs at least 65") != std::string::npos);

  // Weights on NVMe, state in DRAM: the update stages and writes back the weights only; the
  // executor reads them twice more (forward and backward).
  PlacementRequest w;
  w.layers = {layer(1000, 6000)};
  w.layers[0].weight_tier = 2;
  w.layers[0].state_tier = 1;
  w.rates.nvme_read = w.rates.nvme_write = 1000;
  w.dram_budget = 1 << 20;
  w.nvme_budget = 1 << 20;
  REQUIRE(choose_placement(w, &p).is_ok());
  CHECK(p.slot_bytes == 1000);
  CHECK(p.prediction.nvme_read == Approx(3.0));
  CHECK(p.prediction.nvme_write == Approx(1.0));
}
