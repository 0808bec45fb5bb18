// Optimizer state homed on NVMe (STRATA_STATE_PLACEMENT_NVME, STRATA_STATE_PLACEMENT_PLANNED),
// through the C ABI on the backend under test: training with the state staged through DRAM slots is
// bit for bit training with the state in DRAM (every update mode, clipping, slot reuse,
// preemption), and so is training with the weights themselves on NVMe; PLANNED puts the last
// layers' state on NVMe when DRAM is short; checkpoints carry NVMe-homed state; a damaged state
// file fails the optimizer with the tensor's name, and nothing hangs; misuse is refused with a
// message that names the problem. Gradient accumulators on NVMe are test_nvme_accumulators.cpp
// (the same executable; main is here).
#define CATCH_CONFIG_RUNNER
#include <fcntl.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "optimizer/nvme_support.h"

using namespace strata_test;

namespace {

enum class Loop { kAuto, kExplicit };

void train(Model& m, strata_optimizer_t* o, strata_executor_t* ex, Loop loop, int first,
           int steps) {
  if (loop == Loop::kAuto) {
    run_streamed(m, o, ex, first, steps, 1);
  } else {
    run_explicit(m, o, ex, first, steps, 1);
  }
}

// The same steps on the all-DRAM model and the one with NVMe-homed tensors, then every byte
// of their weights and optimizer state compared.
void train_alike(Model& in_dram, strata_optimizer_t* od, strata_executor_t* ed, Model& on_nvme,
                 strata_optimizer_t* on, strata_executor_t* en, Loop loop, int first, int steps) {
  train(in_dram, od, ed, loop, first, steps);
  train(on_nvme, on, en, loop, first, steps);
  REQUIRE(snapshot(on_nvme, on) == snapshot(in_dram, od));
}

// Flips one bit of every byte in the first `bytes` of the file (what is there of them).
void damage_file(const std::string& path, std::size_t bytes) {
  const int fd = open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  std::vector<unsigned char> data(bytes);
  const ssize_t n = pread(fd, data.data(), data.size(), 0);
  REQUIRE(n > 0);
  for (ssize_t i = 0; i < n; ++i) data[static_cast<std::size_t>(i)] ^= 0x10;
  REQUIRE(pwrite(fd, data.data(), static_cast<std::size_t>(n), 0) == n);
  REQUIRE(fsync(fd) == 0);
  close(fd);
}

}  // namespace

TEST_CASE("state on NVMe trains bit for bit as state in DRAM", "[optimizer][nvme]") {
  struct Variant {
    const char* name;
    uint32_t placement;
    Loop loop;
    float max_grad_norm;
    uint64_t staging;  // nvme_staging_bytes
    std::vector<int64_t> sizes = {3000, 1100};
    uint32_t layout = STRATA_MASTER_SEPARATE;  // of both runs
  };
  for (const Variant& var : {
           Variant{"on NVMe, per layer during the backward", STRATA_STATE_PLACEMENT_NVME,
                   Loop::kAuto, 0.f, 0},
           // A layer's state takes 60 KiB of a slot (4 KiB-rounded tensors).
           Variant{"on NVMe, one staging slot for every layer", STRATA_STATE_PLACEMENT_NVME,
                   Loop::kAuto, 0.f, 100000},
           Variant{"on NVMe, clipped: in forward order after the norms",
                   STRATA_STATE_PLACEMENT_NVME, Loop::kAuto, 0.5f, 0},
           Variant{"on NVMe, explicit updates (PyTorch's loop)", STRATA_STATE_PLACEMENT_NVME,
                   Loop::kExplicit, 0.f, 0},
           Variant{"on NVMe, large layers preempted",
                   STRATA_STATE_PLACEMENT_NVME,
                   Loop::kAuto,
                   0.f,
                   0,
                   {300000, 70000}},
           Variant{"planned: DRAM short, the last layers on NVMe", STRATA_STATE_PLACEMENT_PLANNED,
                   Loop::kExplicit, 0.f, 2 * 61440},
           Variant{"split masters on NVMe, explicit updates",
                   STRATA_STATE_PLACEMENT_NVME,
                   Loop::kExplicit,
                   0.f,
                   0,
                   {3000, 1100},
                   STRATA_MASTER_SPLIT},
           Variant{"split masters on NVMe, clipped, one slot",
                   STRATA_STATE_PLACEMENT_NVME,
                   Loop::kAuto,
                   0.5f,
                   100000,
                   {3000, 1100},
                   STRATA_MASTER_SPLIT},
       }) {
    DYNAMIC_SECTION(var.name) {
      ScratchDir scratch;
      const bool large = var.sizes[0] > 100000;
      // PLANNED: DRAM holds the weights, grads and about half of the state.
      const uint64_t dram =
          var.placement == STRATA_STATE_PLACEMENT_PLANNED ? 420 * 1024 : (large ? 64 : 16) * kMiB;
      NvmeConfig nv(scratch, dram, 64 * kMiB);
      strata_optimizer_config_t c = adamw_config();
      c.max_grad_norm = var.max_grad_norm;
      if (var.loop == Loop::kExplicit) c.update_mode = STRATA_UPDATE_EXPLICIT;
      Model in_dram = make_model(5, 42, backend_under_test(), var.sizes);
      Model on_nvme = make_model(5, 42, backend_under_test(), var.sizes, &nv.config);
      OptimizerPtr od = make_optimizer(in_dram, c, var.layout);
      c.state_placement = var.placement;
      c.nvme_staging_bytes = var.staging;
      OptimizerPtr on = make_optimizer(on_nvme, c, var.layout);
      Streamed sd, sn;
      attach_streamed(in_dram, od.get(), &sd);
      attach_streamed(on_nvme, on.get(), &sn);
      train_alike(in_dram, od.get(), sd.ex, on_nvme, on.get(), sn.ex, var.loop, 0, 5);
      // After synchronize (which the loops end with) the NVMe copy is the only one: a write
      // to the state is what the next updates see, not a copy read ahead before it.
      for (Model* m : {&in_dram, &on_nvme}) {
        strata_optimizer_t* o = m == &in_dram ? od.get() : on.get();
        for (std::size_t l : {0u, 3u, 4u}) {
          strata_tensor_t* t = nullptr;
          STRATA_REQUIRE_OK(
              strata_optimizer_get_state(o, m->weights[l][0], STRATA_STATE_EXP_AVG, &t));
          std::vector<float> v(static_cast<std::size_t>(m->sizes[0]), 0.25f);
          STRATA_REQUIRE_OK(strata_tensor_write(m->rt.get(), t, 0, v.data(), v.size() * 4));
        }
      }
      train_alike(in_dram, od.get(), sd.ex, on_nvme, on.get(), sn.ex, var.loop, 5, 2);

      const strata_optimizer_stats_t s = stats_of(on.get());
      const strata_optimizer_stats_t d = stats_of(od.get());
      INFO("nvme params " << s.nvme_state_params << ", layers " << s.nvme_state_layers << ", slots "
                          << s.staging_slots);
      REQUIRE(d.nvme_state_params == 0);
      REQUIRE(d.staging_slots == 0);
      REQUIRE(s.nvme_state_bytes > 0);
      REQUIRE(s.staging_slots >= 1);
      REQUIRE(s.staging_slots <= 4);
      // Every update read its layer's state and wrote it back.
      REQUIRE(s.nvme_read_bytes >= 7 * s.nvme_state_bytes);
      REQUIRE(s.nvme_write_bytes >= 7 * s.nvme_state_bytes);
      if (var.placement == STRATA_STATE_PLACEMENT_NVME) {
        REQUIRE(s.nvme_state_params == 10);
        REQUIRE(s.nvme_state_layers == 5);
        REQUIRE(s.state_bytes == s.staging_bytes);  // no state in DRAM but the slots
        if (var.staging != 0) REQUIRE(s.staging_slots == 1);
      } else {
        // Some but not all: the first layer's state in DRAM, the last layer's on NVMe.
        REQUIRE(s.nvme_state_params > 0);
        REQUIRE(s.nvme_state_params < 10);
        REQUIRE(state_tier(on_nvme, on.get(), on_nvme.weights[0][0], STRATA_STATE_EXP_AVG) ==
                STRATA_TIER_DRAM);
        REQUIRE(state_tier(on_nvme, on.get(), on_nvme.weights[4][1], STRATA_STATE_EXP_AVG) ==
                STRATA_TIER_NVME);
      }
    }
  }
}

TEST_CASE("weights on NVMe train bit for bit as weights in DRAM", "[optimizer][nvme]") {
  // The weights' home is NVMe: every update stages them with the layer's NVMe-homed state and
  // writes them back, and the executor loads a layer again only after that write has landed
  // (a load before it would stream the step before's weights: other grads, other results).
  struct Variant {
    const char* name;
    uint32_t placement;
    Loop loop;
    float max_grad_norm;
    uint32_t layout = STRATA_MASTER_SEPARATE;  // of both runs
  };
  for (const Variant& var : {
           Variant{"split masters: weights and low halves on NVMe, clipped",
                   STRATA_STATE_PLACEMENT_NVME, Loop::kAuto, 0.5f, STRATA_MASTER_SPLIT},
           Variant{"split masters: weights on NVMe, low halves in DRAM",
                   STRATA_STATE_PLACEMENT_DRAM, Loop::kExplicit, 0.f, STRATA_MASTER_SPLIT},
           Variant{"weights and state on NVMe, per layer during the backward",
                   STRATA_STATE_PLACEMENT_NVME, Loop::kAuto, 0.f},
           Variant{"weights and state on NVMe, clipped", STRATA_STATE_PLACEMENT_NVME, Loop::kAuto,
                   0.5f},
           Variant{"weights and state on NVMe, explicit updates", STRATA_STATE_PLACEMENT_NVME,
                   Loop::kExplicit, 0.f},
           Variant{"weights on NVMe, state in DRAM", STRATA_STATE_PLACEMENT_DRAM, Loop::kExplicit,
                   0.f},
       }) {
    DYNAMIC_SECTION(var.name) {
      ScratchDir scratch;
      NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
      strata_optimizer_config_t c = adamw_config();
      c.max_grad_norm = var.max_grad_norm;
      if (var.loop == Loop::kExplicit) c.update_mode = STRATA_UPDATE_EXPLICIT;
      Model in_dram = make_model(5, 42, backend_under_test());
      Model on_nvme =
          make_model(5, 42, backend_under_test(), {3000, 1100}, &nv.config, STRATA_TIER_NVME);
      OptimizerPtr od = make_optimizer(in_dram, c, var.layout);
      c.state_placement = var.placement;
      OptimizerPtr on = make_optimizer(on_nvme, c, var.layout);
      // The masters start from the NVMe-homed weights' values.
      REQUIRE(snapshot(on_nvme, on.get()) == snapshot(in_dram, od.get()));
      Streamed sd, sn;
      attach_streamed(in_dram, od.get(), &sd);
      attach_streamed(on_nvme, on.get(), &sn);
      train_alike(in_dram, od.get(), sd.ex, on_nvme, on.get(), sn.ex, var.loop, 0, 5);
      // A weight written between steps (a checkpoint load, a framework's write) is what the
      // next forward pass streams and the next update starts from.
      for (Model* m : {&in_dram, &on_nvme}) {
        std::vector<uint16_t> v(static_cast<std::size_t>(m->sizes[1]), to_bf16(0.75f));
        STRATA_REQUIRE_OK(
            strata_tensor_write(m->rt.get(), m->weights[2][1], 0, v.data(), v.size() * 2));
      }
      train_alike(in_dram, od.get(), sd.ex, on_nvme, on.get(), sn.ex, var.loop, 5, 3);
      const strata_optimizer_stats_t s = stats_of(on.get());
      REQUIRE(s.staging_slots >= 1);
      // Every update read the layer's weights (and state) and wrote them back: 5 layers of
      // 4 KiB-rounded bf16 weights (8 KiB + 4 KiB) per step, 8 steps.
      const uint64_t weight_bytes = 5 * (8192 + 4096);
      REQUIRE(s.nvme_read_bytes >= 8 * (weight_bytes + s.nvme_state_bytes));
      REQUIRE(s.nvme_write_bytes >= 8 * (weight_bytes + s.nvme_state_bytes));
      if (var.placement == STRATA_STATE_PLACEMENT_DRAM) REQUIRE(s.nvme_state_bytes == 0);
      strata_tier_t tier = -1;
      STRATA_REQUIRE_OK(strata_tensor_tier(on_nvme.rt.get(), on_nvme.weights[0][0], &tier));
      REQUIRE(tier == STRATA_TIER_NVME);
    }
  }
}

TEST_CASE("destroying the optimizer finishes the last update of NVMe-homed weights",
          "[optimizer][nvme]") {
  // strata_optimizer_destroy finishes queued updates: with the executor destroyed first (so
  // nothing detaches and synchronizes), the last step's updates still reach the NVMe-homed
  // weights and state instead of being dropped with their staging slots.
  ScratchDir scratch;
  NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  Model in_dram = make_model(4, 42, backend_under_test());
  Model on_nvme =
      make_model(4, 42, backend_under_test(), {3000, 1100}, &nv.config, STRATA_TIER_NVME);
  std::vector<std::vector<uint16_t>> after[2];
  for (Model* m : {&in_dram, &on_nvme}) {
    strata_optimizer_config_t mc = c;
    if (m == &on_nvme) mc.state_placement = STRATA_STATE_PLACEMENT_NVME;
    OptimizerPtr o = make_optimizer(*m, mc);
    auto st = std::make_unique<Streamed>();
    attach_streamed(*m, o.get(), st.get());
    train(*m, o.get(), st->ex, Loop::kExplicit, 0, 2);
    queue_explicit_step(*m, o.get(), st->ex, 2);
    st.reset();  // the executor goes first
    o.reset();
    after[m == &on_nvme] = bf16_weights(*m);
  }
  REQUIRE(after[1] == after[0]);
}

TEST_CASE("a checkpoint without the optimizer waits for its running updates",
          "[optimizer][nvme][checkpoint]") {
  // strata_optimizer_step returns with the updates queued; with the weights and state on NVMe
  // each update stages, updates and writes back for a while. A save or a load given no
  // optimizer right then must still wait for them: the save holds the updated weights, and a
  // late update does not overwrite the load.
  ScratchDir scratch;
  const std::string path = scratch.file("weights");
  NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
  strata_optimizer_config_t c = adamw_config();
  c.update_mode = STRATA_UPDATE_EXPLICIT;
  c.state_placement = STRATA_STATE_PLACEMENT_NVME;
  Model m = make_model(4, 42, backend_under_test(), {3000, 1100}, &nv.config, STRATA_TIER_NVME);
  OptimizerPtr o = make_optimizer(m, c);
  Streamed st;
  attach_streamed(m, o.get(), &st);
  train(m, o.get(), st.ex, Loop::kExplicit, 0, 2);
  queue_explicit_step(m, o.get(), st.ex, 2);
  STRATA_REQUIRE_OK(strata_checkpoint_save(m.rt.get(), nullptr, path.c_str()));
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(o.get()));
  const auto saved = bf16_weights(m);
  queue_explicit_step(m, o.get(), st.ex, 3);
  STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), nullptr, path.c_str()));
  REQUIRE(bf16_weights(m) == saved);
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(o.get()));
  REQUIRE(bf16_weights(m) == saved);  // no update was left to land after the load
}

TEST_CASE("a checkpoint carries NVMe-homed state and resumes bit for bit",
          "[optimizer][nvme][checkpoint]") {
  ScratchDir scratch;
  const std::string path = scratch.file("ckpt");
  NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
  strata_optimizer_config_t c = adamw_config();
  c.state_placement = STRATA_STATE_PLACEMENT_NVME;
  // The reference: 6 steps in one go.
  Model whole = make_model(4, 7, backend_under_test(), {3000, 1100}, &nv.config);
  OptimizerPtr ow = make_optimizer(whole, c);
  Streamed sw;
  attach_streamed(whole, ow.get(), &sw);
  run_streamed(whole, ow.get(), sw.ex, 0, 3, 1);
  STRATA_REQUIRE_OK(strata_checkpoint_save(whole.rt.get(), ow.get(), path.c_str()));
  run_streamed(whole, ow.get(), sw.ex, 3, 3, 1);
  const auto expected = snapshot(whole, ow.get());

  // Resumed: another model (another NVMe file, other initial values) loads the checkpoint.
  ScratchDir scratch2;
  NvmeConfig nv2(scratch2, 16 * kMiB, 64 * kMiB);
  Model resumed = make_model(4, 99, backend_under_test(), {3000, 1100}, &nv2.config);
  OptimizerPtr orr = make_optimizer(resumed, c);
  Streamed sr;
  attach_streamed(resumed, orr.get(), &sr);
  STRATA_REQUIRE_OK(strata_checkpoint_load(resumed.rt.get(), orr.get(), path.c_str()));
  run_streamed(resumed, orr.get(), sr.ex, 3, 3, 1);
  REQUIRE(snapshot(resumed, orr.get()) == expected);
}

TEST_CASE("damaged NVMe-homed state fails the optimizer by name, and nothing hangs",
          "[optimizer][nvme]") {
  ScratchDir scratch;
  NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
  strata_optimizer_config_t c = adamw_config();
  c.state_placement = STRATA_STATE_PLACEMENT_NVME;
  Model m = make_model(3, 5, backend_under_test(), {3000, 1100}, &nv.config);
  OptimizerPtr o = make_optimizer(m, c);
  Streamed st;
  attach_streamed(m, o.get(), &st);
  run_streamed(m, o.get(), st.ex, 0, 1, 1);
  // The tier holds nothing but the state: damage its first 256 KiB on disk.
  damage_file(nv.file, 256 * 1024);
  // The next step reads the damaged state (ahead of its updates, from its start): the failure
  // surfaces at the next call that reaches the optimizer (an acquire or release, the step's
  // end, or synchronize), whichever comes first.
  std::string message;
  strata_status_t first = step_until_failure(st.ex, 3, &message);
  if (first == STRATA_OK) {
    first = strata_optimizer_synchronize(o.get());
    message = strata_last_error_message();
  }
  INFO(message);
  REQUIRE(first == STRATA_ERROR_DATA_CORRUPTION);
  REQUIRE(message.find("from NVMe") != std::string::npos);
  REQUIRE(message.find("state 'layers.") != std::string::npos);  // the tensor's name
  STRATA_REQUIRE_ERROR(strata_optimizer_synchronize(o.get()), STRATA_ERROR_DATA_CORRUPTION,
                       "from NVMe");
  // The next step is refused with the same reason; destroying everything does not hang.
  STRATA_REQUIRE_ERROR(strata_step_begin(st.ex), STRATA_ERROR_DATA_CORRUPTION, "from NVMe");
}

TEST_CASE("a failed optimizer recovers by a checkpoint load and trains on bit for bit",
          "[optimizer][nvme][checkpoint]") {
  ScratchDir scratch;
  const std::string path = scratch.file("ckpt");
  strata_optimizer_config_t c = adamw_config();
  c.state_placement = STRATA_STATE_PLACEMENT_NVME;
  // The reference: two steps, undisturbed.
  NvmeConfig nr(scratch, 16 * kMiB, 64 * kMiB);
  Model ref = make_model(3, 5, backend_under_test(), {3000, 1100}, &nr.config);
  OptimizerPtr oref = make_optimizer(ref, c);
  Streamed sref;
  attach_streamed(ref, oref.get(), &sref);
  run_streamed(ref, oref.get(), sref.ex, 0, 2, 1);
  const auto expected = snapshot(ref, oref.get());

  // One step, a checkpoint, then the state damaged on disk: the next step fails the optimizer.
  ScratchDir scratch2;
  NvmeConfig nv(scratch2, 16 * kMiB, 64 * kMiB);
  Model m = make_model(3, 5, backend_under_test(), {3000, 1100}, &nv.config);
  OptimizerPtr o = make_optimizer(m, c);
  Streamed st;
  attach_streamed(m, o.get(), &st);
  run_streamed(m, o.get(), st.ex, 0, 1, 1);
  STRATA_REQUIRE_OK(strata_checkpoint_save(m.rt.get(), o.get(), path.c_str()));
  damage_file(nv.file, 64 * kMiB);
  std::string message;
  (void)step_until_failure(st.ex, 3, &message);
  STRATA_REQUIRE_ERROR(strata_optimizer_synchronize(o.get()), STRATA_ERROR_DATA_CORRUPTION,
                       "from NVMe");
  // A failed optimizer's state is not saved; a load with it recovers it (strata.h), and the
  // step it failed in, run again, gives what the undisturbed run gave.
  STRATA_REQUIRE_ERROR(strata_checkpoint_save(m.rt.get(), o.get(), scratch.file("bad").c_str()),
                       STRATA_ERROR_DATA_CORRUPTION, "from NVMe");
  STRATA_REQUIRE_OK(strata_checkpoint_load(m.rt.get(), o.get(), path.c_str()));
  STRATA_REQUIRE_OK(strata_optimizer_synchronize(o.get()));
  run_streamed(m, o.get(), st.ex, 1, 1, 1);
  REQUIRE(snapshot(m, o.get()) == expected);
}

TEST_CASE("NVMe-homed state misuse gets clear errors", "[optimizer][nvme]") {
  SECTION("PLACEMENT_NVME without an NVMe tier") {
    RuntimePtr rt = make_runtime(config_for(backend_under_test(), 16 * kMiB, 16 * kMiB));
    strata_optimizer_config_t c = adamw_config();
    c.state_placement = STRATA_STATE_PLACEMENT_NVME;
    strata_optimizer_t* o = nullptr;
    STRATA_REQUIRE_ERROR(strata_optimizer_create(rt.get(), &c, &o), STRATA_ERROR_INVALID_STATE,
                         "needs an NVMe tier");
    c.state_placement = 7;
    STRATA_REQUIRE_ERROR(strata_optimizer_create(rt.get(), &c, &o), STRATA_ERROR_INVALID_ARGUMENT,
                         "unknown state_placement 7");
    // PLANNED without an NVMe tier is DRAM.
    c.state_placement = STRATA_STATE_PLACEMENT_PLANNED;
    STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &c, &o));
    STRATA_REQUIRE_OK(strata_optimizer_destroy(o));
  }
  SECTION("a manual step, and staging that cannot hold a layer") {
    ScratchDir scratch;
    NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
    strata_optimizer_config_t c = adamw_config();
    c.state_placement = STRATA_STATE_PLACEMENT_NVME;
    c.nvme_staging_bytes = 4096;
    Model m = make_model(2, 5, backend_under_test(), {3000, 1100}, &nv.config);
    OptimizerPtr o = make_optimizer(m, c);
    STRATA_REQUIRE_ERROR(strata_optimizer_step(o.get()), STRATA_ERROR_INVALID_STATE,
                         "only an optimizer attached to an executor updates them");
    Streamed st;
    make_streamed(m, &st, 0);
    STRATA_REQUIRE_ERROR(strata_optimizer_attach(o.get(), st.ex), STRATA_ERROR_OUT_OF_MEMORY,
                         "nvme_staging_bytes 4096");
  }
  SECTION("NVMe-homed weights: a manual step; an HBM weight or an NVMe grad") {
    ScratchDir scratch;
    NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
    Model m = make_model(1, 5, backend_under_test(), {3000, 1100}, &nv.config, STRATA_TIER_NVME);
    OptimizerPtr o = make_optimizer(m, adamw_config());
    STRATA_REQUIRE_ERROR(strata_optimizer_step(o.get()), STRATA_ERROR_INVALID_STATE,
                         "params have their weights on NVMe");
    strata_optimizer_t* raw = nullptr;
    strata_optimizer_config_t c = adamw_config();
    STRATA_REQUIRE_OK(strata_optimizer_create(m.rt.get(), &c, &raw));
    OptimizerPtr other(raw);
    strata_tensor_t* g = register_tensor(m.rt.get(), "nvme.grad", 3000, STRATA_DTYPE_BF16,
                                         STRATA_ROLE_GRAD, STRATA_TIER_NVME);
    strata_param_desc_t p{};
    p.struct_size = STRATA_PARAM_DESC_STRUCT_SIZE;
    p.weight = m.weights[0][0];
    p.grad = g;
    STRATA_REQUIRE_ERROR(
        strata_optimizer_add_param(other.get(), &p), STRATA_ERROR_UNSUPPORTED,
        "grad 'nvme.grad' is in nvme: the optimizer reads grads in DRAM, or in HBM");
    strata_tensor_t* hbm = register_tensor(m.rt.get(), "hbm.weight", 3000, STRATA_DTYPE_BF16,
                                           STRATA_ROLE_WEIGHT, STRATA_TIER_HBM);
    p.weight = hbm;
    p.grad = m.grads[0][0];
    STRATA_REQUIRE_ERROR(strata_optimizer_add_param(other.get(), &p), STRATA_ERROR_UNSUPPORTED,
                         "weight 'hbm.weight' is in hbm");
  }
  SECTION("a 1.0/1.1-sized stats struct gets the fields its size covers") {
    ScratchDir scratch;
    NvmeConfig nv(scratch, 16 * kMiB, 64 * kMiB);
    Model m = make_model(1, 5, backend_under_test(), {3000, 1100}, &nv.config);
    strata_optimizer_config_t c = adamw_config();
    c.state_placement = STRATA_STATE_PLACEMENT_NVME;
    OptimizerPtr o = make_optimizer(m, c);
    strata_optimizer_stats_t s{};
    std::memset(&s, 0xAB, sizeof s);
    s.struct_size = STRATA_STRUCT_SIZE(strata_optimizer_stats_t, binding);
    STRATA_REQUIRE_OK(strata_optimizer_get_stats(o.get(), &s));
    REQUIRE(s.params == 2);
    const auto* tail = reinterpret_cast<const unsigned char*>(&s.nvme_state_bytes);
    REQUIRE(tail[0] == 0xAB);  // past its size: untouched
  }
}

TEST_CASE("a weight whose name leaves no room for a state suffix is trainable",
          "[optimizer][nvme]") {
  ScratchDir scratch;
  const std::string path = scratch.file("ckpt");
  RuntimePtr rt = make_runtime(config_for(backend_under_test(), 16 * kMiB, 16 * kMiB));
  // 255 bytes (the registry's limit), ending in a 2-byte UTF-8 character around the cut.
  std::string name(248, 'w');
  name += "\xc3\xa9";
  name += std::string(255 - name.size(), 'x');
  REQUIRE(name.size() == 255);
  strata_tensor_t* w = register_tensor(rt.get(), name, 64, STRATA_DTYPE_BF16, STRATA_ROLE_WEIGHT);
  strata_tensor_t* g = register_tensor(rt.get(), "g", 64, STRATA_DTYPE_BF16, STRATA_ROLE_GRAD);
  strata_optimizer_config_t c = adamw_config();
  strata_optimizer_t* raw = nullptr;
  STRATA_REQUIRE_OK(strata_optimizer_create(rt.get(), &c, &raw));
  OptimizerPtr o(raw);
  strata_param_desc_t p{STRATA_PARAM_DESC_STRUCT_SIZE, w, g, 0, STRATA_MASTER_SEPARATE,
                        STRATA_GRAD_SUM_ACCUMULATOR};
  STRATA_REQUIRE_OK(strata_optimizer_add_param(o.get(), &p));
  std::vector<std::string> names;
  for (strata_state_kind_t kind :
       {STRATA_STATE_MASTER, STRATA_STATE_EXP_AVG, STRATA_STATE_EXP_AVG_SQ}) {
    strata_tensor_t* s = nullptr;
    STRATA_REQUIRE_OK(strata_optimizer_get_state(o.get(), w, kind, &s));
    strata_tensor_info_t info{};
    info.struct_size = STRATA_TENSOR_INFO_STRUCT_SIZE;
    STRATA_REQUIRE_OK(strata_tensor_get_info(rt.get(), s, &info));
    names.emplace_back(info.name);
    REQUIRE(names.back().size() <= 255);
  }
  REQUIRE(names[0] != names[1]);
  REQUIRE(names[1] != names[2]);
  REQUIRE(names[2].ends_with(".exp_avg_sq"));
  // And the checkpoint (which requires valid UTF-8 names) takes them.
  STRATA_REQUIRE_OK(strata_optimizer_step(o.get()));
  STRATA_REQUIRE_OK(strata_checkpoint_save(rt.get(), o.get(), path.c_str()));
  STRATA_REQUIRE_OK(strata_checkpoint_load(rt.get(), o.get(), path.c_str()));
}

int main(int argc, char** argv) {
  return run_on_backend_under_test(argc, argv);
}
