"""A second distribution layer over an offloaded model is refused (issue 37, item 4;
strata.torch._foreign): torch's DistributedDataParallel and FSDP2's fully_shard (and the
composable replicate) when they are built, DeepSpeed's engine when it moves the model to its
device, FSDP1 and a DDP around a module holding the model at the first training forward. Each
message names the wrapper, says why and names st.offload's own data parallelism; where the
refusal comes before the wrapper changed anything, the model then trains exactly as a twin that
never met the wrapper. On the CPU, over gloo with one rank (offload is then not data parallel
itself); accelerate's single-process prepare() keeps working."""
import importlib.util

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)

import rank_launch  # noqa: E402
import strata.torch as st  # noqa: E402
from torch_parity_models import DEVICE, LR, WD, batches, build  # noqa: E402
from torch_parity_models import train as parity_train  # noqa: E402

if DEVICE.type != "cpu":
    pytest.skip("these run on the CPU over gloo (STRATA_PARITY_DEVICE is %s)" % DEVICE,
                allow_module_level=True)

WHY = "Strata already owns the memory of its parameters"
ROAD = "data_parallel=strata.torch.DataParallel"
UNCHANGED = "Nothing was changed: the model trains as it is, without the wrapper"
STEPS = 3


@pytest.fixture
def group():
    """torch.distributed's default group: gloo, one rank, on a free local port."""
    port = rank_launch.free_port()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def train(model, opt, data):
    """The ordinary loop (torch_parity_models.train): the per-step losses."""
    return parity_train(model, opt, data)[0]


def reference_losses(offload):
    """The losses of an offloaded model that never met a wrapper."""
    model = offload(build("llama"))
    return train(model, st.AdamW(model.parameters(), lr=LR, weight_decay=WD), batches(STEPS))


def assert_refusal(error, wrapper):
    text = str(error.value)
    assert wrapper in text and "cannot wrap an offloaded model" in text, text
    assert WHY in text and "data-parallel reduction" in text, text
    assert ROAD in text and "docs/python-guide.md" in text, text


def assert_trains_as_before(model, opt, expected):
    """The model, after the refusal and without the wrapper, trains to the losses of a twin
    that never met it (bit for bit: the same arithmetic)."""
    if opt is None:
        opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    assert train(model, opt, batches(STEPS)) == expected


# Optimizer made before the wrapper (the session built: the streamed parameters are Strata's
# placeholders) or after it (the parameters still hold their initial values).
ORDERS = pytest.mark.parametrize("optimizer_first", [True, False], ids=["built", "unbuilt"])


@ORDERS
def test_ddp_is_refused_when_built(offload, group, one_torch_thread, optimizer_first):
    expected = reference_losses(offload)
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD) if optimizer_first else None
    with pytest.raises(RuntimeError) as error:
        torch.nn.parallel.DistributedDataParallel(model)
    assert_refusal(error, "torch.nn.parallel.DistributedDataParallel")
    assert UNCHANGED in str(error.value)
    assert_trains_as_before(model, opt, expected)


def test_ddp_around_a_module_holding_the_model_is_refused_at_the_first_forward(
        offload, group, one_torch_thread):
    """DDP reads nothing from a module nested in the one it wraps; its forward is seen."""
    expected = reference_losses(offload)
    model = offload(build("llama"))

    class Outer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids, labels):
            return self.inner(ids, labels=labels)

    wrapped = torch.nn.parallel.DistributedDataParallel(Outer(model))  # before the optimizer
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError) as error:
        wrapped(ids, labels=ids)
    assert_refusal(error, "torch.nn.parallel.DistributedDataParallel")
    assert "Nothing was run" in str(error.value)
    del wrapped
    assert_trains_as_before(model, opt, expected)


@ORDERS
@pytest.mark.parametrize("where", ["model", "blocks"])
def test_fully_shard_is_refused_when_applied(offload, group, one_torch_thread, optimizer_first,
                                             where):
    """FSDP2's order (each block, then the model) or the model alone: the first call refuses,
    before the contract records the API or FSDP touches a parameter."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    fully_shard = getattr(fsdp, "fully_shard", None)
    if fully_shard is None:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    expected = reference_losses(offload)
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD) if optimizer_first else None
    target = model.model.layers[0] if where == "blocks" else model
    classes = [type(m) for m in model.modules()]
    with pytest.raises(RuntimeError) as error:
        fully_shard(target)
    assert_refusal(error, "torch.distributed.fsdp.fully_shard (FSDP2)")
    assert UNCHANGED in str(error.value)
    assert fully_shard.state(target) is None
    from torch.distributed._composable.contract import _get_registry
    assert _get_registry(target) is None  # the registry the contract made, removed
    assert [type(m) for m in model.modules()] == classes
    assert_trains_as_before(model, opt, expected)


def test_fully_shard_past_the_contract_guard_is_refused_at_the_first_forward(
        offload, group, one_torch_thread):
    """Where the contract's state cannot be guarded (another torch: the guard removed here),
    the module fully_shard changed is seen at the first training forward."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed._composable.contract import STATE_KEY
    model = offload(build("llama"))
    for m in model.modules():
        del m.__dict__[STATE_KEY]
    fsdp.fully_shard(model)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError) as error:
        model(ids, labels=ids)
    assert_refusal(error, "torch.distributed.fsdp.fully_shard (FSDP2)")
    assert "offload it again" in str(error.value)


def test_composable_replicate_is_refused_when_applied(offload, group, one_torch_thread):
    try:
        from torch.distributed._composable.replicate import replicate
    except ImportError:
        pytest.skip("this torch has no composable replicate")
    expected = reference_losses(offload)
    model = offload(build("llama"))
    with pytest.raises(RuntimeError) as error:
        replicate(model)
    assert_refusal(error, "torch.distributed's composable replicate")
    assert_trains_as_before(model, None, expected)


def test_composable_checkpoint_is_not_a_distribution_layer(offload, group):
    """Other composable APIs pass the guard as before (their state kept as in a plain dict)."""
    from torch.distributed._composable import checkpoint
    model = offload(build("llama"))
    checkpoint(model.lm_head)
    assert checkpoint.state(model.lm_head) is not None


def test_fsdp1_is_refused_at_the_first_forward(offload, group, one_torch_thread):
    """FSDP1 reads nothing from the model it wraps that could refuse it when built, and its
    constructor flattens the parameters: refused at its first training forward, saying to
    offload the model again. (On the CPU FSDP1 needs device_id="cpu"; over a built session
    its constructor fails by itself, flattening Strata's placeholders.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel
    model = offload(build("llama"))
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    ids = batches(1)[0]
    with pytest.raises(RuntimeError) as error:
        wrapped(ids, labels=ids)
    assert_refusal(error, "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)")
    assert "offload the model again" in str(error.value)


class DeepSpeedEngine(torch.nn.Module):
    """A stand-in for deepspeed.runtime.engine.DeepSpeedEngine, found by its class name and
    module: what its constructor does first with the model (takes it, moves it to its device)."""

    def __init__(self, model):
        super().__init__()
        self.module = model
        self.module.to("cpu")


DeepSpeedEngine.__module__ = "deepspeed.runtime.engine"


def test_deepspeed_engine_is_refused_when_it_moves_the_model(offload, one_torch_thread):
    expected = reference_losses(offload)
    model = offload(build("llama"))
    with pytest.raises(RuntimeError) as error:
        DeepSpeedEngine(model)
    assert_refusal(error, "DeepSpeed")
    assert_trains_as_before(model, None, expected)
    model.to("cpu")  # not from an engine: a move that changes nothing passes, as before


@ORDERS
def test_deepspeed_initialize_is_refused(offload, group, one_torch_thread, optimizer_first,
                                         monkeypatch):
    """The real deepspeed.initialize, where DeepSpeed is installed (ZeRO-3, its optimizer or
    ours)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (the stand-in test covers the detection)")
    deepspeed = pytest.importorskip("deepspeed")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    expected = reference_losses(offload)
    model = offload(build("llama"))
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
    opt = None
    if optimizer_first:
        opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}
    with pytest.raises(RuntimeError) as error:
        deepspeed.initialize(model=model, optimizer=opt, config=config)
    assert_refusal(error, "DeepSpeed")
    assert_trains_as_before(model, opt, expected)


def test_accelerate_single_process_prepare_still_trains(offload, one_torch_thread):
    """accelerate's prepare() on one process wraps nothing: it trains as before."""
    accelerate = pytest.importorskip("accelerate")
    expected = reference_losses(offload)
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    losses = []
    for ids in batches(STEPS):
        loss = model(ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == expected
