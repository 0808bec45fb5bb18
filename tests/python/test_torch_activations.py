"""strata.torch.activations: the measurement behind "resident blocks keep their activations
when memory allows" (the parity of running them that way is test_torch_parity's
test_resident_blocks with keep=True)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from strata.torch.activations import (ActivationKeeper, plan_kept, saved_bytes, saves_output,
                                      selective_bytes, selective_context, shape_of, tokens_of,
                                      COSTLY_OPS)
from torch_parity_models import ARCHS, DEVICE, build


def real_saved_bytes(module, args, kwargs):
    """What autograd really saves in a forward of `module`, beside its parameters."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args, **kwargs)
    return total


@pytest.mark.parametrize("arch", ARCHS)
def test_fake_forward_measures_what_autograd_saves(arch):
    """The bytes measured on fake tensors (no memory, no compute) are what a real forward of
    a Hugging Face decoder layer saves, for the inputs the model gives it; and measuring
    leaves the RNG where it was."""
    block, args, kwargs = captured_block_call(arch, dropout=0.1 if arch == "gpt2" else 0.0)
    state = torch.get_rng_state()
    fake = saved_bytes(block.forward, args, kwargs, DEVICE, list(block.parameters()))
    assert torch.equal(torch.get_rng_state(), state)
    assert fake is not None and fake > 0
    assert fake == real_saved_bytes(block, args, kwargs)
    assert tokens_of(args) == 32 and shape_of(args) == (32, 16)


def test_plan_and_the_tokens_guard():
    """count = (usable - peak - margin) // block bytes, within [0, blocks]; the last blocks
    keep theirs, and only for inputs no larger than the measured ones."""
    gb = 1 << 30
    assert plan_kept(140 * gb, 100 * gb, 4 * gb, 28, 14 * gb) == (6, 6)
    assert plan_kept(80 * gb, 79 * gb, gb, 10, 8 * gb) == (0, 0)
    assert plan_kept(140 * gb, gb, gb, 5, 0) == (5, 5)
    assert plan_kept(140 * gb, gb, 0, 5, 0) == (0, 0)
    keeper = ActivationKeeper(torch.device("cpu"), [object()] * 4)
    keeper.count, keeper.whole, keeper.tokens, keeper.seq = 2, 2, 1024, 512

    def inputs(batch, seq):
        return (torch.empty(batch, seq, 8),)

    assert [keeper.mode(i, inputs(2, 512)) for i in range(4)] == [None, None, "whole", "whole"]
    assert keeper.mode(3, inputs(4, 512)) is None  # more tokens than measured: checkpointed
    assert keeper.mode(3, inputs(1, 1024)) is None  # as many tokens, a longer sequence: too
    keeper.on_step()
    keeper.on_step()
    assert keeper.count == 2  # on the CPU nothing is measured or decided


def test_plan_buys_selective_blocks_first_then_upgrades():
    """Spare memory keeps as many blocks selectively as fit, then upgrades the last ones to
    whole with what is left; a block that cannot be kept selectively (None), or whose
    selective bytes are no smaller, is kept wholly or not at all."""
    gb = 1 << 30
    # 26 GB spare: 5 blocks of 5 GB wholly, or 9 of 2.8 GB selectively (25.2), 0.8 left: none
    # upgraded (2.2 each).
    assert plan_kept(140 * gb, 100 * gb, 5 * gb, 28, 14 * gb, int(2.8 * gb)) == (9, 0)
    # 3 blocks only: all three selective (6 GB), 20 left upgrades all three (3 x 3 GB).
    assert plan_kept(140 * gb, 100 * gb, 4 * gb, 3, 14 * gb, 1 * gb) == (3, 3)
    # 3 blocks, 7 GB spare: three selective (3), 4 left upgrades one (3 each).
    assert plan_kept(140 * gb, 119 * gb, 4 * gb, 3, 14 * gb, 1 * gb) == (3, 1)
    assert plan_kept(140 * gb, 100 * gb, 4 * gb, 28, 14 * gb, None) == (6, 6)
    assert plan_kept(140 * gb, 100 * gb, 4 * gb, 28, 14 * gb, 4 * gb) == (6, 6)
    assert plan_kept(100 * gb, 100 * gb, 4 * gb, 28, 14 * gb, gb) == (0, 0)
    keeper = ActivationKeeper(torch.device("cpu"), [object()] * 5)
    keeper.count, keeper.whole, keeper.tokens, keeper.seq = 3, 1, 1024, 512
    x = (torch.empty(2, 512, 8),)
    assert [keeper.mode(i, x) for i in range(5)] == [None, None, "selective", "selective",
                                                      "whole"]
    assert keeper.describe() == "3 keep their activations (2 of them only their matrix " \
        "products' and attention's outputs)"
    keeper.forced, keeper.forced_whole = 2, 0
    assert [keeper.mode(i, x) for i in range(5)] == [None, None, None, "selective",
                                                      "selective"]
    assert "2 keep their activations (2 of them only" in keeper.describe()


def captured_block_call(arch, dropout=0.0):
    """(block, args, kwargs): the first decoder layer of a small Hugging Face model and the
    inputs the model gives it, the hidden states requiring grad."""
    model = build(arch, dropout=dropout)
    block = model.transformer.h[0] if arch == "gpt2" else model.model.layers[0]
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        model(ids, use_cache=False)
    handle.remove()
    args, kwargs = captured["call"]
    args = tuple(a.detach().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point()
                 else a for a in args)
    return block, args, kwargs


class CountingOps(TorchDispatchMode):
    """Counts the ops dispatched while active, by overload packet."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] = self.counts.get(func.overloadpacket, 0) + 1
        return func(*args, **(kwargs or {}))

    def costly(self):
        return sum(n for op, n in self.counts.items() if op in COSTLY_OPS)


@pytest.mark.parametrize("arch", ARCHS)
def test_selective_keeping_skips_the_costly_recompute(arch):
    """A selectively kept block runs no matrix product or attention again in its backward
    pass (as many as a block that keeps everything, fewer than a checkpointed one), its grads
    equal plain autograd's bit for bit, and the bytes measured on fake tensors are what
    torch's selective checkpointing really holds: fewer than keeping everything, and fewer
    than caching every product (the last one, past the recompute's early stop, is not)."""
    block, args, kwargs = captured_block_call(arch)
    measured, limit = selective_bytes(block.forward, args, kwargs, DEVICE)
    everything, costly_ops = selective_bytes(block.forward, args, kwargs, DEVICE, everything=True)

    def backward_of(mode):
        x = args[0].detach().requires_grad_(True)
        call = (x,) + args[1:]
        if mode == "whole":
            out = block(*call, **kwargs)
        else:
            extra = {"context_fn": lambda: selective_context(limit)} \
                if mode == "selective" else {}
            out = checkpoint(block.forward, *call, use_reentrant=False, **extra, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        block.zero_grad(set_to_none=True)
        counting = CountingOps()
        with counting:
            out.sum().backward()
        return counting.costly(), [x.grad] + [p.grad for p in block.parameters()]

    costly = {m: backward_of(m) for m in ("whole", "selective", "checkpoint")}
    assert costly["selective"][0] == costly["whole"][0] < costly["checkpoint"][0]
    for got, expected in zip(costly["selective"][1], costly["whole"][1]):
        assert torch.equal(got, expected)

    held = []

    def spying_context():
        caching, cached = selective_context(limit)
        held.append(caching)
        return caching, cached

    out = checkpoint(block.forward, *args, use_reentrant=False, context_fn=spying_context,
                     **kwargs)
    real, seen = 0, set()
    for wrapper in sac_cached(held[0].storage):
        for t in tree_leaves(wrapper.val):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                real += t.untyped_storage().nbytes()
    del out
    whole = saved_bytes(block.forward, args, kwargs, DEVICE, list(block.parameters()))
    assert measured == real > 0
    assert limit < costly_ops and measured < everything < whole
    # Without torch's early stop the recompute runs the whole block: every product is cached.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert selective_bytes(block.forward, args, kwargs, DEVICE) == (everything, costly_ops)


def sac_cached(storage):
    """The cache entries torch's selective checkpointing holds (their .val the outputs)."""
    for entries in storage.values():
        for entry in (entries.values() if isinstance(entries, dict) else entries):
            if hasattr(entry, "val"):
                yield entry


def test_random_ops_and_mutated_outputs_are_not_cached():
    """Attention with dropout is recomputed (the RNG offsets of the recompute must follow the
    forward's), attention without it and matrix products are cached; a block that writes in
    place into a product's output cannot be kept selectively."""
    aten = torch.ops.aten
    q = torch.randn(1, 2, 8, 4)
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert saves_output(flash, (q, q, q, 0.0), {})
    assert not saves_output(flash, (q, q, q, 0.1), {})
    assert not saves_output(flash, (q, q, q), {"dropout_p": 0.1})
    assert saves_output(aten.mm.default, (q[0, 0], q[0, 0].T), {})
    assert not saves_output(aten.native_dropout.default, (q, 0.1, True), {})
    assert not saves_output(aten.add.Tensor, (q, q), {})

    linear = torch.nn.Linear(4, 4)

    def scaled_in_place(x):
        y = linear(x)
        y.mul_(2)
        return y

    def activated_in_place(x):  # a bias-free projection of 3-D input: mm, then _unsafe_view
        return torch.nn.functional.silu(projection(x), inplace=True)

    projection = torch.nn.Linear(4, 4, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    x3 = torch.randn(2, 3, 4, requires_grad=True)
    cpu = torch.device("cpu")
    assert selective_bytes(lambda x: linear(x) * 2, (x,), {}, cpu, everything=True)[0] > 0
    assert selective_bytes(scaled_in_place, (x,), {}, cpu) is None
    assert selective_bytes(lambda x: torch.nn.functional.silu(projection(x)), (x3,), {}, cpu,
                           everything=True)[0] > 0
    assert selective_bytes(activated_in_place, (x3,), {}, cpu) is None


def test_an_out_of_memory_error_turns_keeping_off():
    """An out-of-memory error in a forward pass while blocks keep their activations says so,
    and the next steps recompute again (the measured plan did not hold for that step)."""
    from strata.torch.block import note_memory

    class Session:
        resident_blocks = [object()] * 3
        activations = ActivationKeeper(torch.device("cpu"), [object()] * 3)

    Session.activations.count = 2
    error = torch.OutOfMemoryError("CUDA out of memory (simulated)")
    note_memory(Session, error)
    assert Session.activations.count == 0
    assert any("were keeping their activations" in n for n in error.__notes__), error.__notes__
