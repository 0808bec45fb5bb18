"""strata.torch's per-parameter bookkeeping (strata.torch._params): a side table keyed weakly by
the parameter, not attributes on torch's objects. A parameter's death frees its entry; a swap
of its data (which torch refuses for a tensor with weak references) keeps it; offload leaves no
attributes of its own on the model's parameters, and a failed offload leaves no entries."""

import gc

import pytest

torch = pytest.importorskip("torch")

import strata.torch as st  # noqa: E402
from strata.torch import _params, _surgery  # noqa: E402
from torch_parity_models import DEVICE, build  # noqa: E402


class _Owner:
    """A stand-in for the session (held weakly, as the table holds sessions)."""


def test_an_entry_dies_with_its_parameter_and_survives_a_swap():
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(3))
    owner = _Owner()
    _params.set_owner(p, owner)
    _params.mark_loaded(p)
    _surgery.swap_data(p, torch.zeros(3))  # meta to real: torch.utils.swap_tensors
    assert not p.is_meta and _params.owner(p) is owner and _params.take_loaded(p)
    assert not _params.take_loaded(p)  # taken once
    key, (ref, _) = id(p), _params._table[id(p)]
    del p
    gc.collect()
    assert ref() is None and _params._table.get(key, (None,))[0] is not ref
    q = torch.nn.Parameter(torch.ones(2))
    _params.keep_fp32(q, q.detach().clone())
    _params.note_fp32_version(q)
    assert _params.fp32_version(q) == q._version
    _params.drop_fp32(q)  # nothing left of it: no entry either
    assert _params.fp32(q) is None and id(q) not in _params._table


def test_offload_puts_no_attributes_on_parameters(offload):
    model = build("llama")
    before = {n: set(vars(p)) for n, p in model.named_parameters()}
    model = offload(model, dtype=torch.bfloat16, resident_blocks=1)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    assert {n: set(vars(p)) for n, p in model.named_parameters()} == before
    streamed = [p for b in model.strata.blocks for p in b.parameters()]
    assert streamed and all(_params.owner(p) is model.strata for p in streamed)
    assert all(_params.fp32(p) is None for p in model.parameters())  # AdamW took them
    del opt


def test_the_table_keeps_no_model_alive():
    """The table holds parameters weakly and their sessions weakly: a dropped offloaded model
    (never closed) is collected with its runtime, as before the table (a session held
    strongly by its parameters' entries kept it, and its pinned memory, for good)."""
    import weakref
    model = st.offload(build("llama"), device=DEVICE, resident_blocks=0)
    session = weakref.ref(model.strata)
    runtime = weakref.ref(model.strata.runtime)
    del model
    gc.collect()
    assert session() is None and runtime() is None


def test_a_failed_offload_leaves_no_entries(monkeypatch):
    """The head is moved last: the embedding and the final norm were cast to bf16 by then,
    keeping their fp32 values in the table, and the streamed blocks' parameters were marked
    as the session's. All of it is undone."""
    model = build("llama")
    materialize = _surgery.materialize
    kept = []

    def fail(module, *args, **kwargs):
        if module is model.lm_head:
            kept.append(_params.fp32(model.model.norm.weight) is not None)
            raise RuntimeError("injected")
        return materialize(module, *args, **kwargs)

    monkeypatch.setattr(_surgery, "materialize", fail)
    with pytest.raises(RuntimeError, match="injected"):
        st.offload(model, device=DEVICE, dtype=torch.bfloat16, resident_blocks=0)
    assert kept == [True] and getattr(model, "strata", None) is None
    assert all(id(p) not in _params._table for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
