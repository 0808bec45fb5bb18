"""What the parity suites (tests/python/torch/test_torch_parity*.py) share beside
torch_parity_models: the step count, one intra-op thread per test module, the strata.torch
side of a run (st.offload and st.AdamW), the Strata runtimes left open, and the small
regression nets' data and loop with the check that a model trains on as plain PyTorch after a
refused call."""
import gc

import pytest
import torch

import strata.core
import strata.torch as st

from torch_parity_models import (
    DEVICE, LR, WD, assert_losses_close, assert_state_close, deepcopy, plain_adamw, snapshot,
    synchronize, train)

STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: intra-op threads only cost (a step takes 5 ms on one thread and
    up to 1.7 s on two busy cores, where OpenMP's barriers spin). Both sides run in this
    process with the same setting; restored for the other test files."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def strata_adamw(params, **kwargs):
    return st.AdamW(params, **{"lr": LR, "weight_decay": WD, **kwargs})


def strata_run(offload, model, data, params=None, opt_kwargs=None, **loop):
    """The same with the model offloaded and st.AdamW over the same params."""
    model = offload(model)
    opt = strata_adamw(model.parameters() if params is None else params(model),
                       **(opt_kwargs or {}))
    losses, norms = train(model, opt, data, **loop)
    synchronize(opt)
    return losses, norms, snapshot(model)


def open_runtimes():
    """Strata runtimes alive and not closed in this process (a failed offload must not leave
    one holding its pinned memory)."""
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if type(o) is strata.core.Runtime and getattr(o, "_handle", None) is not None)


def assert_trains_on_as_plain(base, model, opt, data=None, loop=None):
    """After a refused call: `model` (offloaded from a copy of `base`, `opt` its optimizer)
    trains on `data` as a plain-PyTorch copy of `base` does. `loop(model, opt)` -> losses
    (default: train over `data`)."""
    loop = loop or (lambda m, o: train(m, o, data)[0])
    plain = deepcopy(base)
    expected = loop(plain, plain_adamw(plain.parameters()))
    got = loop(model, opt)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def regression_data(steps, rows):
    """`steps` (x, y) pairs for the small regression nets below: x [rows, 8], y [rows, 1]."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, 8, generator=gen).to(DEVICE) for _ in range(steps)]
    ys = [torch.randn(rows, 1, generator=gen).to(DEVICE) for _ in range(steps)]
    return xs, ys


def mse_steps(model, opt, xs, ys):
    """One optimizer step per (x, y), MSE loss; the losses."""
    losses = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def smallest_host_budget(counts, element_size, grads="dram"):
    """The least host_budget offload accepts with NVMe: every block's weights on NVMe (and with
    grads="hbm", the buffer the grads are read through)."""
    layers = strata.core.placement_layers(counts, element_size, grads=grads)
    low, high = 0, strata.core.full_dram(layers)
    while low < high:
        mid = (low + high) // 2
        try:
            strata.core.place(layers, dram_budget=mid, nvme_budget=1 << 50)
            high = mid
        except MemoryError:
            low = mid + 1
    return low
