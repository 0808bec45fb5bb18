"""strata.torch.gathered (issue 40 item 3): streamed parameters with their real values inside a
with-block, for reading (weight norms, an EMA of the weights, parameters_to_vector) and, with
writable=True, writing; checked against the same plain PyTorch model trained the same steps
(fp32, the CPU, the tiny Hugging Face Llama of torch_parity_models), and its refusals."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    LR, WD, assert_losses_close, assert_state_close, batches, blocks_of, build, deepcopy,
    plain_adamw, snapshot, synchronize)

transformers.logging.set_verbosity_error()

STEPS = 3
DECAY = 0.9


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sides(offload, steps=STEPS):
    """(plain model, its optimizer), (offloaded model, st.AdamW), the same seed, and the data."""
    base = build("llama")
    plain = deepcopy(base)
    model = offload(deepcopy(base))
    return (plain, plain_adamw(plain.parameters())), \
        (model, st.AdamW(model.parameters(), lr=LR, weight_decay=WD)), batches(steps)


def step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def assert_placeholders(model):
    """Outside the context every streamed parameter reads NaN again (its placeholder)."""
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            assert torch.isnan(p.detach()).all(), name


def test_reading_gives_the_values_plain_pytorch_trained(offload):
    (plain, popt), (model, sopt), data = sides(offload)
    for ids in data:
        step(plain, popt, ids)
        step(model, sopt, ids)
    expected = {n: p.detach().clone() for n, p in plain.named_parameters()}
    with st.gathered(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        for name, p in model.named_parameters():
            assert p.dtype == expected[name].dtype and p.device == expected[name].device
    assert_state_close(got, expected)
    # What model.state_dict() returns for each, exactly.
    state = snapshot(model)
    for name, value in got.items():
        assert torch.equal(value.cpu(), state[name]), name
    assert_placeholders(model)


def test_a_subset_of_modules_or_parameters(offload):
    (plain, _), (model, sopt), _ = sides(offload)
    block = blocks_of(model)[1]
    inside = list(block.parameters())
    with st.gathered(block):
        assert all(not torch.isnan(p.detach()).any() for p in inside)
        # Only the block asked for: block 0 stays on its placeholder.
        assert all(torch.isnan(p.detach()).all() for p in blocks_of(model)[0].parameters())
    weight = blocks_of(model)[0].mlp.up_proj.weight
    with st.gathered([weight]):
        assert torch.equal(weight.detach(), blocks_of(plain)[0].mlp.up_proj.weight.detach())
    assert_placeholders(model)


def test_ema_of_the_weights_across_steps_equals_plain_pytorch(offload):
    (plain, popt), (model, sopt), data = sides(offload)

    def ema_start(m):
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    def ema_update(ema, m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                ema[n].mul_(DECAY).add_(p, alpha=1 - DECAY)

    plain_ema = ema_start(plain)
    with st.gathered(model):
        strata_ema = ema_start(model)
    plain_losses, strata_losses = [], []
    for ids in data:
        plain_losses.append(step(plain, popt, ids))
        ema_update(plain_ema, plain)
        strata_losses.append(step(model, sopt, ids))
        with st.gathered(model):
            ema_update(strata_ema, model)
    assert_losses_close(strata_losses, plain_losses)
    assert_state_close(strata_ema, plain_ema)


def test_parameters_to_vector_and_norms_inside(offload):
    (plain, popt), (model, sopt), data = sides(offload)
    for ids in data:
        step(plain, popt, ids)
        step(model, sopt, ids)
    expected = torch.nn.utils.parameters_to_vector(plain.parameters())
    with st.gathered(model):
        got = torch.nn.utils.parameters_to_vector(model.parameters())
        norms = [p.norm().item() for p in model.parameters()]
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.tensor(norms),
                               torch.tensor([p.norm().item() for p in plain.parameters()]),
                               atol=1e-5, rtol=1e-6)
    assert_placeholders(model)


def test_writes_with_writable_true_train_on_as_plain_pytorch(offload):
    """In place through the parameter, through .data, and by vector_to_parameters (which
    assigns .data); then training goes on from the written values, as in plain PyTorch."""
    (plain, popt), (model, sopt), data = sides(offload, steps=4)

    def write(m):
        with torch.no_grad():
            blocks = blocks_of(m)
            blocks[0].mlp.up_proj.weight.mul_(0.5)
            blocks[1].self_attn.q_proj.weight.data.add_(0.01)
            params = list(blocks[1].mlp.parameters())
            vector = torch.nn.utils.parameters_to_vector(params)
            torch.nn.utils.vector_to_parameters(vector * 1.5, params)

    plain_losses, strata_losses = [], []
    for i, ids in enumerate(data):
        if i == 2:
            write(plain)
            with st.gathered(model, writable=True):
                write(model)
            assert_placeholders(model)
            assert_state_close(snapshot(model), snapshot(plain))
        plain_losses.append(step(plain, popt, ids))
        strata_losses.append(step(model, sopt, ids))
    synchronize(sopt)
    assert_losses_close(strata_losses, plain_losses)
    assert_state_close(snapshot(model), snapshot(plain))


def test_writable_false_detects_a_write_and_stores_nothing(offload):
    (plain, popt), (model, sopt), data = sides(offload)
    step(model, sopt, data[0])
    before = snapshot(model)
    weight = blocks_of(model)[0].mlp.down_proj.weight
    with pytest.raises(RuntimeError, match=r"writable=True.*mlp\.down_proj\.weight|"
                                           r"mlp\.down_proj\.weight.*writable=True"):
        with st.gathered(model):
            weight.data.mul_(2.0)  # through .data: no version counter sees it
    assert_state_close(snapshot(model), before, exact=True)
    assert_placeholders(model)
    with pytest.raises(RuntimeError, match="writable=True"):
        with st.gathered(model):
            with torch.no_grad():
                weight.zero_()
    assert_state_close(snapshot(model), before, exact=True)
    # The session trains on.
    step(model, sopt, data[1])


def test_refusals(offload):
    (plain, popt), (model, sopt), data = sides(offload)
    step(model, sopt, data[0])
    ids = data[1]
    with st.gathered(model):
        with pytest.raises(RuntimeError, match="nested"):
            with st.gathered(model):
                pass
        with pytest.raises(RuntimeError, match="inside strata.torch.gathered"):
            model(ids, labels=ids)
        with pytest.raises(RuntimeError, match="inside strata.torch.gathered"):
            with torch.no_grad():
                model(ids)
        with pytest.raises(RuntimeError, match="inside strata.torch.gathered"):
            sopt.step()
        with pytest.raises(RuntimeError, match="inside strata.torch.gathered"):
            model.load_state_dict(snapshot(plain))
    assert_placeholders(model)
    context = st.gathered(blocks_of(model)[0])
    with context:
        with pytest.raises(RuntimeError, match="nested"):
            with context:
                pass
    with context:  # a context may be used again once left
        assert not torch.isnan(blocks_of(model)[0].mlp.up_proj.weight.detach()).any()
    # A write into a placeholder before is refused (the existing message), not overwritten,
    # and the context stays usable.
    placeholder = blocks_of(model)[0].mlp.up_proj.weight
    with torch.no_grad():
        placeholder.fill_(1.0)
    with pytest.raises(RuntimeError, match="written in place outside its block"):
        with context:
            pass
    with context:
        assert not torch.isnan(blocks_of(model)[0].mlp.up_proj.weight.detach()).any()
    # Between a forward pass with grad and its backward: the step's weights are in flight.
    loss = model(ids, labels=ids).loss
    with pytest.raises(RuntimeError, match="training step"):
        with st.gathered(model):
            pass
    assert_placeholders(model)
    loss.backward()
    sopt.step()
    sopt.zero_grad()
    with st.gathered(model):  # usable again
        assert not torch.isnan(blocks_of(model)[0].mlp.up_proj.weight.detach()).any()


def test_before_the_build(offload):
    """Before the optimizer exists the blocks still hold their own values: read as they are;
    a model built on the meta device has none yet: refused, naming the fix."""
    base = build("llama")
    model = offload(deepcopy(base))
    with st.gathered(model):
        got = snapshot(model)
    assert_state_close(got, snapshot(base), exact=True)
    with torch.device("meta"):
        meta = type(base)(base.config)
    meta = offload(meta)
    with pytest.raises(RuntimeError, match="no values yet"):
        with st.gathered(meta):
            pass


def test_plain_parameters_pass_through(offload):
    """Parameters of no offloaded model (and the offloaded model's resident ones) are left as
    they are."""
    linear = torch.nn.Linear(3, 3)
    before = linear.weight.detach().clone()
    with st.gathered(linear, writable=True):
        assert torch.equal(linear.weight.detach(), before)


def test_bf16_writes_set_the_master_as_load_state_dict_and_keep_the_others(offload):
    """In bf16 the gathered value is the bf16 weight (what state_dict returns); a written
    parameter's fp32 master becomes its written value widened (as load_state_dict sets it),
    and an unwritten one keeps its master (gathering and leaving does not round it)."""
    model = offload(build("llama"), dtype=torch.bfloat16)
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ids = batches(1)[0]
    step(model, opt, ids)
    synchronize(opt)
    session = model.strata
    written = blocks_of(model)[0].mlp.up_proj.weight
    kept = blocks_of(model)[0].mlp.down_proj.weight
    master_before = session.read_state(session.by_id[id(kept)], "master")
    assert not torch.equal(master_before, master_before.bfloat16().float())  # a real master
    with torch.no_grad(), st.gathered(model, writable=True):
        assert written.dtype == torch.bfloat16
        assert torch.equal(written.detach().cpu(),
                           model.state_dict()["model.layers.0.mlp.up_proj.weight"])
        written.mul_(0.5)
        value = written.detach().clone()
    assert torch.equal(session.read_state(session.by_id[id(written)], "master"),
                       value.float().cpu())
    assert torch.equal(session.read_state(session.by_id[id(kept)], "master"), master_before)
    step(model, opt, ids)  # trains on
