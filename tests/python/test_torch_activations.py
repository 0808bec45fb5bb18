"""strata.torch.activations: the measurement behind "resident blocks keep their activations
when memory allows" (the parity of running them that way is test_torch_parity's
test_resident_blocks with keep=True)."""
import pytest
import torch

from strata.torch.activations import (ActivationKeeper, plan_kept, saved_bytes, shape_of,
                                      tokens_of)
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
    model = build(arch, dropout=0.1 if arch == "gpt2" else 0.0)
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
    assert plan_kept(140 * gb, 100 * gb, 4 * gb, 28, 14 * gb) == 6
    assert plan_kept(80 * gb, 79 * gb, gb, 10, 8 * gb) == 0
    assert plan_kept(140 * gb, gb, gb, 5, 0) == 5
    assert plan_kept(140 * gb, gb, 0, 5, 0) == 0
    keeper = ActivationKeeper(torch.device("cpu"), [object()] * 4)
    keeper.count, keeper.tokens, keeper.seq = 2, 1024, 512

    def inputs(batch, seq):
        return (torch.empty(batch, seq, 8),)

    assert [keeper.keeps(i, inputs(2, 512)) for i in range(4)] == [False, False, True, True]
    assert not keeper.keeps(3, inputs(4, 512))  # more tokens than measured: checkpointed
    assert not keeper.keeps(3, inputs(1, 1024))  # as many tokens, a longer sequence: too
    keeper.on_step()
    keeper.on_step()
    assert keeper.count == 2  # on the CPU nothing is measured or decided


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
