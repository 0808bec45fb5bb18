"""strata.torch.allocator: offload turns torch's expandable segments on unless the process
configured the allocator, and the activation keeper's margin follows what the allocator does.
The switch itself is faked on the CPU (torch's setter recorded); on CUDA
(STRATA_PARITY_DEVICE=cuda) offload's real effect and its undo on failure are checked."""
import pytest
import torch

import strata.torch as st
from strata.torch import _allocator as allocator
from strata.torch import _step
from torch_parity_models import ARCHS, DEVICE, build

CUDA = torch.device("cuda", 0)


@pytest.fixture(params=["getter", "no getter", "old setter"])
def fake_torch(request, monkeypatch):
    """torch's allocator settings as a string this test owns (read back through torch's
    getter where it has one: torch 2.11 has none; set through the old setter's name on older
    torch), the native backend, no environment settings, and strata.torch not having changed
    anything yet."""
    state = {"settings": "", "calls": [], "getter": request.param == "getter"}

    def setter(text):
        state["calls"].append(text)
        state["settings"] = text

    for name in ("_accelerator_setAllocatorSettings",
                 "_cuda_cudaCachingAllocator_set_allocator_settings",
                 "_accelerator_getAllocatorSettings"):
        monkeypatch.delattr(torch._C, name, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"
                        if request.param == "old setter" else
                        "_accelerator_setAllocatorSettings", setter, raising=False)
    if state["getter"]:
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings",
                            lambda: state["settings"], raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "_turned_on", False)
    monkeypatch.setattr(allocator, "_applied", set())
    return state


def test_turns_expandable_segments_on_and_undoes(fake_torch):
    undo = allocator.prefer_expandable_segments(CUDA)
    assert fake_torch["calls"] == ["expandable_segments:True"]
    assert allocator.expandable_segments()
    assert allocator.user_configured() is None  # its own setting is not the process's
    # The step plan's margin follows the allocator: 4% of the device with expandable segments.
    assert _step.margin_bytes(1000) == 40
    assert allocator.prefer_expandable_segments(CUDA) is None  # once per process
    undo()
    assert fake_torch["calls"][-1] == "expandable_segments:False"
    assert not allocator.expandable_segments()
    assert _step.margin_bytes(1000) == 100  # 10% without
    # A later offload (after a failed one) turns them on again: its own undo is not the
    # process's setting.
    assert allocator.prefer_expandable_segments(CUDA) is not None
    assert fake_torch["calls"][-1] == "expandable_segments:True"


def test_a_later_change_by_the_process_is_seen(fake_torch):
    """The process turns expandable segments off after offload (as torch's IPC error advises):
    the keeper's margin follows, where torch can say what its settings are."""
    allocator.prefer_expandable_segments(CUDA)
    fake_torch["settings"] = "expandable_segments:False"  # torch's setter, called by the user
    assert allocator.expandable_segments() == (not fake_torch["getter"])


@pytest.mark.parametrize("name", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
@pytest.mark.parametrize("value,expandable", [
    ("expandable_segments:False", False),
    ("max_split_size_mb:512", False),
    ("max_split_size_mb:512,expandable_segments:True", True),
    ("expandable_segments: True", True),
    ("expandable_segments:true", False),  # torch refuses it: not what torch runs
])
def test_leaves_a_configured_process_alone(fake_torch, monkeypatch, name, value, expandable):
    monkeypatch.setenv(name, value)
    assert allocator.prefer_expandable_segments(CUDA) is None
    assert fake_torch["calls"] == []
    assert allocator.user_configured() == value
    assert allocator.expandable_segments() == expandable
    assert _step.margin_bytes(1000) == (40 if expandable else 100)


def test_an_empty_variable_is_unset(fake_torch, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert allocator.prefer_expandable_segments(CUDA) is not None


def test_leaves_settings_applied_in_process_alone(fake_torch):
    fake_torch["settings"] = "garbage_collection_threshold:0.8"  # the user's own call
    changed = allocator.prefer_expandable_segments(CUDA) is not None
    # Only a torch with the getter can tell (torch 2.11 cannot: the module says so).
    assert changed == (not fake_torch["getter"])


def test_leaves_other_backends_and_the_cpu_alone(fake_torch, monkeypatch):
    assert allocator.prefer_expandable_segments(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert allocator.prefer_expandable_segments(CUDA) is None
    assert fake_torch["calls"] == []
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF",
                       "backend:cudaMallocAsync,expandable_segments:True")
    assert not allocator.expandable_segments()


def new_segment_is_expandable():
    """Whether a fresh allocation lands in an expandable segment (torch's memory snapshot).
    The cache is emptied first: a cached segment of either kind would serve it."""
    torch.cuda.empty_cache()
    x = torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE)
    segment = [s for s in torch.cuda.memory_snapshot()
               if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
    assert len(segment) == 1, segment
    return bool(segment[0].get("is_expandable"))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the real allocator needs CUDA")
def test_offload_sets_the_real_allocator_and_a_failed_offload_undoes_it(monkeypatch):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if allocator.user_configured() is not None:
        pytest.skip("this process configured the allocator before the test")
    # From the default allocator, whatever an earlier offload in this process did; restored
    # to what it was after.
    was_on = allocator._turned_on
    allocator._set_settings("expandable_segments:False")
    monkeypatch.setattr(allocator, "_turned_on", False)
    try:
        check_offload_and_its_undo(monkeypatch)
    finally:
        allocator._set_settings("expandable_segments:%s" % was_on)
        allocator._turned_on = was_on


def check_offload_and_its_undo(monkeypatch):
    assert not new_segment_is_expandable()

    import sys
    offload_module = sys.modules["strata.torch._surgery"]  # the package's name is the function

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    model = build(ARCHS[0])
    with monkeypatch.context() as m:
        m.setattr(offload_module, "materialize", fail)
        with pytest.raises(RuntimeError, match="injected"):
            st.offload(model, device=DEVICE)
    assert getattr(model, "strata", None) is None
    assert not allocator.expandable_segments()
    assert not new_segment_is_expandable()

    model = st.offload(build(ARCHS[0]), device=DEVICE)
    try:
        assert allocator.expandable_segments()
        assert new_segment_is_expandable()
    finally:
        model.strata.close()
