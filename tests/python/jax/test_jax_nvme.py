"""strata.jax.Trainer with an NVMe tier (nvme=, host_budget=, as strata.torch.offload takes
them): the package's small JAX Llama, whose training state exceeds the DRAM budget given,
trains on the host backend with the library's placement putting the optimizer state (and, on
the smallest budget, every block's weights) in NVMe files under a temporary directory; the
losses and the final weights (and fp32 masters) equal the all-DRAM run's bit for bit, and
where everything lives is read back from the runtime (tensor tiers, the optimizer's stats),
not from the arguments. Budgets that cannot hold the model even with NVMe, and NVMe options
without nvme=, are refused with errors naming them."""
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import strata.core  # noqa: E402
import jax_parity_models as api  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
STEPS = 3
_DRAM_RUNS = {}  # (dtype, ffi): the all-DRAM run, shared by the cases that compare with it


def counts_of(blocks):
    return [[int(np.prod(np.shape(leaf))) for leaf in jax.tree_util.tree_leaves(b)]
            for b in blocks]


def smallest_host_budget(layers):
    """The least DRAM budget the library's placement accepts with an NVMe tier (every block's
    weights and state there): what strata_placement_create refuses one byte below."""
    low, high = 0, strata.core.full_dram(layers)
    while low < high:
        mid = (low + high) // 2
        try:
            strata.core.place(layers, dram_budget=mid, nvme_budget=1 << 50)
            high = mid
        except MemoryError:
            low = mid + 1
    return low


def train(dtype, ffi, **kw):
    """Losses, final weights and fp32 masters (None for fp32 weights: their own masters) and,
    with nvme=, where the state was (placement_info) and what the optimizer read from NVMe."""
    blocks, residents = api.llama_params()
    data = api.batches(STEPS)
    with api.llama_trainer(blocks, residents, dtype=dtype, ffi=ffi, **kw) as trainer:
        where = trainer.placement_info()
        losses = [trainer.step(ids) for ids in data]
        got_blocks, got_res = trainer.get_params()
        masters = trainer.get_params(masters=True)[0] if dtype == jnp.bfloat16 else None
        stats = trainer.optimizer.stats()
        placement = trainer.placement
    return {"losses": losses, "blocks": got_blocks, "res": got_res, "masters": masters,
            "where": where, "nvme_read": stats["nvme_read_bytes"], "placement": placement}


def dram_run(dtype, ffi):
    key = (str(dtype), ffi)
    if key not in _DRAM_RUNS:
        _DRAM_RUNS[key] = train(dtype, ffi)
    return _DRAM_RUNS[key]


def assert_bitwise(expected, got, what):
    for (path, e), g in zip(jax.tree_util.tree_leaves_with_path(expected),
                            jax.tree_util.tree_leaves(got)):
        assert np.array_equal(np.asarray(e), np.asarray(g)), (what, jax.tree_util.keystr(path))


@pytest.mark.parametrize("case, dtype, ffi", [
    ("state", jnp.float32, None),  # the last blocks' state on NVMe
    ("weights", jnp.bfloat16, None),  # every block's weights and state (masters too)
    ("weights", jnp.float32, False),  # the same through the host-synchronised loop
    ("all_state", jnp.float32, None),  # state_placement="nvme", the default host budget
], ids=["state_fp32", "weights_bf16", "weights_fp32_host_loop", "all_state_fp32"])
def test_state_beyond_dram_trains_bit_for_bit(case, dtype, ffi, tmp_path):
    blocks, _ = api.llama_params()
    element = jnp.dtype(dtype).itemsize
    layers = strata.core.placement_layers(counts_of(blocks), element)
    kw = {"nvme": str(tmp_path / "tier")}
    if case == "state":
        # Room for the weights, the grads, the first two blocks' state and one staging slot:
        # the state of the blocks after them cannot be in DRAM.
        kw["host_budget"] = (sum(l["weight_bytes"] + l["grad_bytes"] for l in layers)
                             + sum(l["state_bytes"] for l in layers[:2])
                             + max(l["state_bytes"] for l in layers))
    elif case == "weights":
        kw["host_budget"] = smallest_host_budget(layers)
    else:
        kw["state_placement"] = "nvme"
    if "host_budget" in kw:
        # The state exceeds the budget: the all-DRAM layout would not fit in it.
        assert kw["host_budget"] < strata.core.full_dram(layers)
        assert kw["host_budget"] < sum(l["weight_bytes"] + l["grad_bytes"] + l["state_bytes"]
                                       for l in layers)
    got = train(dtype, ffi, **kw)
    expected = dram_run(dtype, ffi)

    assert got["losses"] == expected["losses"]  # exact floats
    assert_bitwise(expected["blocks"], got["blocks"], "blocks")
    assert_bitwise(expected["res"], got["res"], "residents")
    if dtype == jnp.bfloat16:
        assert_bitwise(expected["masters"], got["masters"], "fp32 masters")
    assert expected["losses"][-1] < expected["losses"][0]  # it trains

    # Where the state was, as the runtime says (not the arguments): the DRAM run has nothing
    # on NVMe; this one has, and its updates read it back from there.
    none = expected["where"]
    assert expected["placement"] is None and none["nvme_state_params"] == 0
    assert {t for layer in none["weights"] + none["state"] for t in layer} == {"dram"}
    where, n = got["where"], len(blocks)
    leaves = len(where["weights"][0])
    assert got["placement"] is not None and where["nvme_used_bytes"] > 0, where
    assert where["nvme_state_params"] > 0 and where["staging_slots"] > 0, where
    assert got["nvme_read"] > 0
    state_on_nvme = [all(t == "nvme" for t in layer) for layer in where["state"]]
    weights_on_nvme = [all(t == "nvme" for t in layer) for layer in where["weights"]]
    # The optimizer fills DRAM param by param in forward order: a spilled block's params small
    # enough for what DRAM has left (its norms) keep their state there, the rest is staged.
    assert sum(layer.count("nvme") for layer in where["state"]) == \
        where["nvme_state_params"], where
    assert "nvme" in where["state"][-1], where
    # The placement counts a param's state with the optimizer's margins (never below what it
    # allocates), so the optimizer stages at most the layers the placement spilled.
    assert 0 < where["nvme_state_layers"] <= got["placement"].info["state_nvme_layers"], where
    if case == "state":
        assert 0 < where["nvme_state_layers"] < n, where
        assert "nvme" not in where["state"][0], where
        assert not any(weights_on_nvme), where
    elif case == "weights":
        assert all(weights_on_nvme) and where["nvme_state_layers"] == n, where
    else:
        assert all(state_on_nvme) and where["nvme_state_params"] == n * leaves, where
    # The homes the library chose are the ones registered.
    assert weights_on_nvme == [w == "nvme" for w, _ in got["placement"].homes]


def test_budgets_that_cannot_hold_the_model_are_refused(tmp_path):
    """A host_budget below what DRAM needs even with every block's weights and state on NVMe,
    and an nvme_budget that leaves no room after the tier's margins, are refused before a
    runtime exists, naming the budget; NVMe options without nvme= are refused too."""
    blocks, residents = api.llama_params()
    layers = strata.core.placement_layers(counts_of(blocks), 4)
    low = smallest_host_budget(layers)
    tier = str(tmp_path / "tier")
    with pytest.raises(ValueError, match=r"strata.jax.Trainer: host_budget %d bytes is below "
                                         r"what DRAM needs with training state and weights on "
                                         r"NVMe" % (low - 1)):
        api.llama_trainer(blocks, residents, nvme=tier, host_budget=low - 1)
    with pytest.raises(ValueError, match=r"nvme_budget 1048576 bytes leaves no room"):
        api.llama_trainer(blocks, residents, nvme=tier, nvme_budget=1 << 20)
    with pytest.raises(ValueError, match=r"state_placement='nvme' needs nvme="):
        api.llama_trainer(blocks, residents, state_placement="nvme")
    with pytest.raises(ValueError, match=r"nvme_budget=4096 without nvme="):
        api.llama_trainer(blocks, residents, nvme_budget=4096)
    with pytest.raises(ValueError, match=r"state_placement is 'disk', not 'planned' or 'nvme'"):
        api.llama_trainer(blocks, residents, nvme=tier, state_placement="disk")


def test_offloaded_equinox_model_with_nvme_trains_as_in_dram(tmp_path):
    """strata.jax.offload passes nvme= and host_budget= to its Trainer: an Equinox Llama
    (test_jax_equinox's) trained by its own eqx.filter_jit step with every block's weights and
    state on NVMe (the smallest host budget) equals the same offload in DRAM bit for bit."""
    pytest.importorskip("equinox")
    import equinox as eqx
    from strata.jax import _ffi
    try:
        _ffi.load()
    except _ffi.FfiUnavailable as e:  # offload needs the FFI ops
        pytest.skip("the FFI library cannot be built here: %s" % e)
    import importlib.util
    import pathlib
    import strata.jax as sj
    where_eq = pathlib.Path(__file__).with_name("test_jax_equinox.py")  # its model and step
    spec = importlib.util.spec_from_file_location("_jax_nvme_equinox", where_eq)
    eq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eq)

    data = eq.batches(3)
    runs = []
    for kw in ({}, {"nvme": str(tmp_path / "tier")}):
        model = eq.Llama(jax.random.key(0))
        if kw:
            counts = [[int(np.prod(leaf.shape[1:])) for leaf in
                       jax.tree_util.tree_leaves(eqx.filter(model.layers, eqx.is_array))]
                      ] * eq.LAYERS
            kw["host_budget"] = smallest_host_budget(strata.core.placement_layers(counts, 4))
        model, trainer = sj.offload(model, "layers", block_optimizer=sj.AdamW(eq.LR,
                                                                            weight_decay=eq.WD),
                                    **kw)
        with trainer:
            where = trainer.placement_info()
            model, losses = eq.train(model, data)
            blocks = eqx.filter(model.layers.plain(), eqx.is_array)
        runs.append((losses, blocks, where))
    (expected, plain_blocks, _), (got, nvme_blocks, where) = runs
    assert got == expected and expected[-1] < expected[0]
    assert_bitwise(plain_blocks, nvme_blocks, "blocks")
    assert all(t == "nvme" for layer in where["weights"] for t in layer), where
    assert where["nvme_state_layers"] == eq.LAYERS, where
