"""Loading weights into an offloaded model in the orders users take from plain PyTorch: before
the optimizer exists (fine-tuning from pretrained weights or a checkpoint with a fresh
optimizer), on a model built on the meta device, and with load_state_dict's assign=True.
The oracle is the plain model that loaded the same weights; each case either trains exactly
like it or is refused before anything changes. (A third new-user trial found each of these
silently wrong or leaving the model untrainable.)"""
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    DEVICE, LR, WD, assert_state_close, batches, build, config, deepcopy, model_class,
    plain_adamw, snapshot, synchronize, train)

transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def meta_model(arch="llama"):
    with torch.device("meta"):
        return model_class(arch)(config(arch)).train()


def plain_with(weights, data):
    """The plain model holding `weights`, trained on `data`: (losses, its state after)."""
    plain = build("llama", seed=11)
    plain.load_state_dict(weights)
    losses, _ = train(plain, plain_adamw(plain.parameters()), data, clip=1.0)
    return losses, snapshot(plain)


def strata_trained(model, data):
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, _ = train(model, opt, data, clip=1.0)
    synchronize(opt)
    return losses, snapshot(model)


@pytest.mark.parametrize("partial", [False, True])
def test_a_meta_model_loads_its_weights_before_the_optimizer(partial, offload):
    """A model built on the meta device, offloaded, then model.load_state_dict(pretrained),
    then the optimizer: the streamed blocks stayed on meta (torch's load of a meta parameter
    is a no-op with a warning) and the optimizer then initialized them at random, under the
    loaded embedding; load_state_dict said all keys matched. The blocks take the loaded values
    now, and a partial load (strict=False) leaves only the missing tensors to the model's
    init (the init of a module must not overwrite its loaded neighbours)."""
    weights = snapshot(build("llama", seed=3))
    data = batches(3)
    model = offload(meta_model())
    load = dict(weights)
    if partial:  # the first block's attention output and one MLP matrix come from the init
        for key in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            del load[key]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "copying ... to a meta parameter ... no-op"
        result = model.load_state_dict(load, strict=not partial)
    assert sorted(result.missing_keys) == sorted(set(weights) - set(load))
    got, state = strata_trained(model, data)
    if not partial:
        expected, expected_state = plain_with(weights, data)
        assert got == pytest.approx(expected, rel=1e-5)
        assert_state_close(state, expected_state)
        return
    # Loaded tensors: trained from the loaded values (their neighbours in the same module
    # included); the missing ones: from the init, not from the loaded model's.
    fresh = offload(meta_model())
    fresh.load_state_dict(load, strict=False)
    opt = st.AdamW(fresh.parameters(), lr=LR, weight_decay=WD)
    start = snapshot(fresh)
    for key in load:
        assert torch.equal(start[key], weights[key].to(start[key].dtype)), key
    for key in set(weights) - set(load):
        assert not torch.equal(start[key], weights[key]), key
        assert torch.isfinite(start[key]).all(), key
    del opt


def test_a_checkpoint_loaded_before_the_optimizer_trains(offload, tmp_path):
    """st.load_checkpoint(path, model) (the weights, to train on with a fresh optimizer)
    before the optimizer exists: the load put the blocks into Strata without optimizer state,
    and creating the optimizer afterwards was refused ('create the optimizer once, before the
    first forward pass with grad') for good. The optimizer now lays the blocks out again, from
    the loaded weights: training goes on exactly as the plain model loaded with them."""
    saved = offload(build("llama", seed=3))
    opt = st.AdamW(saved.parameters(), lr=LR, weight_decay=WD)
    train(saved, opt, batches(1), clip=1.0)
    synchronize(opt)
    path = str(tmp_path / "ck")
    st.save_checkpoint(path, saved, opt)
    weights = snapshot(saved)
    data = batches(3)

    model = offload(build("llama", seed=5))
    st.load_checkpoint(path, model)
    with torch.no_grad():  # an evaluation between the load and the optimizer
        model(data[0], labels=data[0])
    assert_state_close(snapshot(model), weights, exact=True)
    got, state = strata_trained(model, data)
    expected, expected_state = plain_with(weights, data)
    assert got == pytest.approx(expected, rel=1e-5)
    assert_state_close(state, expected_state)


def test_frozen_blocks_take_an_optimizer_made_after_a_forward_pass(offload):
    """Blocks all frozen: a forward pass with grad before the optimizer puts them into Strata
    with no optimizer state, and none is needed: the optimizer made afterwards (for the
    embedding, norms and head) trains as plain PyTorch's. Unfrozen after that build, the
    blocks would need the state the build did not lay out, from values it narrowed: the
    optimizer is refused then, naming the order."""
    base = build("llama", seed=3)
    data = batches(3)
    plain = deepcopy(base)
    model = offload(deepcopy(base))
    for m in (plain, model):
        for block in m.model.layers:
            block.requires_grad_(False)
    ids = data[0]
    for m in (plain, model):
        m(ids, labels=ids).loss.backward()
        m.zero_grad()
    expected, _ = train(plain, plain_adamw(plain.parameters()), data, clip=1.0)
    got, state = strata_trained(model, data)
    assert got == pytest.approx(expected, rel=1e-5)
    assert_state_close(state, snapshot(plain))

    unfrozen = offload(deepcopy(base))
    for block in unfrozen.model.layers:
        block.requires_grad_(False)
    unfrozen(ids, labels=ids).loss.backward()
    for block in unfrozen.model.layers:
        block.requires_grad_(True)
    with pytest.raises(RuntimeError, match="create the optimizer once"):
        st.AdamW(unfrozen.parameters(), lr=LR)


def test_a_checkpoint_saved_before_the_optimizer_is_refused(offload, tmp_path):
    """st.save_checkpoint(path, model) before the optimizer: it moved the blocks into Strata
    (without optimizer state) and the optimizer could then never be created. Refused, naming
    the order, with nothing written and the model still trainable."""
    base = build("llama", seed=3)
    data = batches(2)
    model = offload(deepcopy(base))
    path = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="create the optimizer.*nothing was saved"):
        st.save_checkpoint(str(path), model)
    assert not path.exists() and not (tmp_path / "ck.partial").exists()
    got, state = strata_trained(model, data)
    expected, expected_state = plain_with(snapshot(base), data)
    assert got == pytest.approx(expected, rel=1e-5)
    assert_state_close(state, expected_state)


def test_load_state_dict_with_assign_is_refused(offload):
    """model.load_state_dict(sd, assign=True) replaces the model's Parameter objects in plain
    PyTorch (the optimizer then holds the old ones and updates nothing); on an offloaded model
    the streamed parameters stayed and kept training while the resident ones were replaced and
    froze. Refused before anything is loaded; a load without assign then works."""
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    train(model, opt, batches(1), clip=1.0)
    synchronize(opt)
    before = snapshot(model)
    params = list(model.parameters())
    other = snapshot(build("llama", seed=9))
    with pytest.raises(RuntimeError, match="assign=True.*nothing was loaded"):
        model.load_state_dict(deepcopy(other), assign=True)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert_state_close(snapshot(model), before, exact=True)
    model.load_state_dict(other)
    assert_state_close(snapshot(model), other, exact=True)
