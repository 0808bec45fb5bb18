"""Block checkpoints spilled to host memory (strata.torch._spill, offload(spill_checkpoints=)).

A spilled checkpoint is copied out and back bit for bit, so a run that spills every block
(spill_checkpoints=True: on the CPU into ordinary host tensors, on a GPU into pinned buffers
through a side stream) must equal the same run without spilling bit for bit (losses, every
grad after each backward, every weight), and plain PyTorch within the parity suite's
tolerances. Models: the tiny Hugging Face Llama and the package's own Llama (bench/llama_zoo);
idioms: accumulation, Hugging Face gradient checkpointing, resident blocks, the chunked loss,
the batch's shape changing between steps, a step that raises midway. The automatic decision
is the library's step plan (its cases: tests/unit/test_step_plan.cpp); here what strata.torch
gives it and does with its choice, and on a GPU with the device made to look short. The GPU variants run wherever a GPU is (the lead's STRATA_PARITY_DEVICE=cuda runs
included) and skip without one."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402
from strata.torch import _spill  # noqa: E402

import torch_parity_models as tpm  # noqa: E402

transformers.logging.set_verbosity_error()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
STEPS = 4


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    yield


@pytest.fixture
def no_tf32():
    """fp32 means fp32 on a GPU: TF32 off, restored afterwards. Set and read back as plain
    attributes (torch 2.11 serves them through a module __getattr__, which monkeypatch takes
    for a missing attribute and then fails to delete)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_llama(device, layers=3, seed=0):
    torch.manual_seed(seed)
    model = tpm.model_class("llama")(tpm.config("llama", layers))
    return model.train().to(device)


def zoo_llama(device, layers=3, seed=0):
    from llama_zoo.torch_llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tpm.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return model.train().to(device)


def data(device, shapes=((2, 16),) * STEPS, seed=0):
    """Token ids of the given shapes, two fixed batches per shape in turn (as the parity
    suite's: the loss falls visibly, and AdamW does not sit near eps on rows seen once)."""
    out = []
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(seed + i % 2)
        out.append(torch.randint(3, tpm.VOCAB, shape, generator=g).to(device))
    return out


def grads(model):
    return {n: p.grad.detach().clone().cpu() for n, p in model.named_parameters()
            if p.grad is not None}


def train(model, opt, batches, accumulate=1, fail_at=None):
    """The plain loop; per micro-batch the loss and the grads after its backward. fail_at: the
    micro-batch whose forward raises (after the blocks ran: in the final norm), the loop then
    zeroing the grads and going on."""
    losses, seen = [], []
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    for i, ids in enumerate(batches):
        if i == fail_at:
            handle = norm.register_forward_hook(lambda *a: (_ for _ in ()).throw(
                RuntimeError("failing on purpose")))
            with pytest.raises(RuntimeError, match="failing on purpose"):
                model(ids, labels=ids)
            handle.remove()
            opt.zero_grad()
            continue
        loss = model(ids, labels=ids).loss
        (loss / accumulate).backward()
        losses.append(loss.item())
        seen.append(grads(model))
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    tpm.synchronize(opt)
    return losses, seen, tpm.snapshot(model)


def strata_run(build, device, spill, batches, offload_kwargs=None, gradient_checkpointing=False,
               **loop):
    model = build(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"resident_blocks": 0, **(offload_kwargs or {})}
    model = st.offload(model, device=device, spill_checkpoints=spill, **kwargs)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        out = train(model, opt, batches, **loop)
        return out, model.strata.spill.spilled_total, model.strata.host_pinned_extra_bytes(), \
            model.strata.placement()
    finally:
        model.strata.close()


def plain_run(build, device, batches, gradient_checkpointing=False, chunk_tokens=None,
              **loop):
    model = build(device)
    if chunk_tokens is not None:  # the same chunked loss on the plain model
        from strata.torch import _chunked_loss
        _chunked_loss.install(model, chunk_tokens)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
    return train(model, opt, batches, **loop)


def assert_bit_identical(got, expected):
    (g_losses, g_grads, g_state), (e_losses, e_grads, e_state) = got, expected
    assert g_losses == e_losses
    assert len(g_grads) == len(e_grads)
    for step, (g, e) in enumerate(zip(g_grads, e_grads)):
        assert sorted(g) == sorted(e), step
        for name in e:
            assert torch.equal(g[name], e[name]), "step %d: grad of %s differs" % (step, name)
    tpm.assert_state_close(g_state, e_state, exact=True)


def assert_close_to_plain(got, plain):
    """The parity suite's comparisons: the losses step by step, the grads of the first
    backward (later ones follow weights that Strata's CPU AdamW rounded in another order,
    within the tolerance), the final weights."""
    tpm.assert_losses_close(got[0], plain[0])
    for name, e in plain[1][0].items():
        tpm.assert_grad_close(name, got[1][0][name], e)
    # AdamW near eps (the parity suite's allowance): torch 2.15's CPU kernels left one
    # element of the shape-changing run 1.28e-6 off after four steps.
    tpm.assert_state_close(got[2], plain[2], outliers=2, outlier_atol=1e-4)


CASES = {
    "hf": dict(build=hf_llama),
    "zoo": dict(build=zoo_llama),
    "accumulation": dict(build=hf_llama, loop=dict(accumulate=2)),
    "gradient_checkpointing": dict(build=hf_llama, gradient_checkpointing=True),
    "resident_blocks": dict(build=hf_llama, offload_kwargs=dict(resident_blocks=2)),
    "chunked_loss": dict(build=hf_llama, offload_kwargs=dict(chunked_loss=8)),
    "shape_changes": dict(build=hf_llama, shapes=((2, 16), (3, 24), (1, 8), (3, 24))),
    "raises_midway": dict(build=hf_llama, shapes=((2, 16),) * 5, loop=dict(fail_at=2)),
    "zoo_resident_accumulation": dict(build=zoo_llama, loop=dict(accumulate=2),
                                      offload_kwargs=dict(resident_blocks=1)),
}


def _hf_checkpoint_wraps_call():
    """Whether Hugging Face gradient checkpointing wraps a layer's __call__, and so a streamed
    block (transformers up to 5.17), rather than the class's forward, which offload replaces
    (later releases: no checkpoint around a streamed block)."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    return "__call__" in vars(GradientCheckpointingLayer)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_spilled_checkpoints_train_bit_for_bit(case, device, no_tf32):
    """Every block spilled at every step: the same losses, grads and weights as without
    spilling, bit for bit, and plain PyTorch's within the parity tolerances (on a GPU both
    sides the same fp32 arithmetic: no TF32)."""
    spec = CASES[case]
    batches = data(device, spec.get("shapes", ((2, 16),) * STEPS))
    loop = spec.get("loop", {})
    common = dict(offload_kwargs=spec.get("offload_kwargs"),
                  gradient_checkpointing=spec.get("gradient_checkpointing", False), **loop)
    spilled, count, pinned, placement = strata_run(spec["build"], device, True, batches,
                                                   **common)
    kept, none, _, _ = strata_run(spec["build"], device, False, batches, **common)
    plain = plain_run(spec["build"], device, batches,
                      gradient_checkpointing=spec.get("gradient_checkpointing", False),
                      chunk_tokens=(spec.get("offload_kwargs") or {}).get("chunked_loss"),
                      **loop)
    assert none == 0
    if spec.get("gradient_checkpointing") and _hf_checkpoint_wraps_call():
        # That checkpoint keeps each block's input on the device itself: nothing spills
        # inside it, in any mode (it would free nothing).
        assert count == 0, count
        assert "block checkpoints kept on the device (the blocks run inside " \
            "torch.utils.checkpoint" in placement, placement
    else:
        # Every block's checkpoint at every forward pass (the failed one's too: its blocks ran
        # before the raise).
        assert count == 3 * len(batches), count
        assert pinned > 0
        assert "3 of 3 block checkpoints spilled to host memory" in placement
    assert_bit_identical(spilled, kept)
    assert_close_to_plain(spilled, plain)


def test_bad_values_are_refused_before_anything_changes():
    for bad in ("yes", 1, 0, "auto"):
        model = hf_llama("cpu")
        with pytest.raises(ValueError, match="spill_checkpoints is"):
            st.offload(model, device="cpu", resident_blocks=0, spill_checkpoints=bad)
        assert getattr(model, "strata", None) is None


def test_automatic_never_spills_on_the_cpu():
    batches = data("cpu")
    (_, _, _), count, pinned, placement = strata_run(hf_llama, "cpu", None, batches)
    assert count == 0 and pinned == 0
    assert "spilled" not in placement


def test_host_refusing_buffers_falls_back_to_keeping_them(monkeypatch):
    """The pool refuses buffers when the host lacks memory: nothing spills, the step trains as
    without spilling, and an out-of-memory error would say why."""
    from strata import errors, host_buffers

    def refused(runtime, nbytes, name="", before_free=None):  # as the runtime's reserve rule
        raise errors.OutOfMemory(2, "host buffer '%s': would leave less than the reserve" % name)
    monkeypatch.setattr(host_buffers, "HostBuffer", refused)
    batches = data("cpu")
    model = st.offload(hf_llama("cpu"), device="cpu", resident_blocks=0, spill_checkpoints=True)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        got = train(model, opt, batches)
        spiller = model.strata.spill
        assert spiller.spilled_total == 0 and spiller.count == 0
        assert model.strata.host_pinned_extra_bytes() == 0
        assert "were refused" in spiller.note()
        from strata.torch._block import note_spill
        error = torch.OutOfMemoryError("CUDA out of memory (simulated)")
        note_spill(model.strata, error)
        assert any("block checkpoint buffer(s) of host memory were refused" in n
                   for n in error.__notes__), error.__notes__
    finally:
        model.strata.close()
    kept, _, _, _ = strata_run(hf_llama, "cpu", False, batches)
    assert_bit_identical(got, kept)


def test_buffers_are_reused_and_grow_with_the_batch():
    model = st.offload(hf_llama("cpu"), device="cpu", resident_blocks=0, spill_checkpoints=True)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        pool = model.strata.spill.pool
        train(model, opt, data("cpu", ((2, 16),) * 2))
        first = {k: v.data_ptr() for k, v in pool.buffers.items()}
        assert model.strata.host_pinned_extra_bytes() == 3 * 2 * 16 * 64 * 4
        train(model, opt, data("cpu", ((1, 16),)))  # smaller: the same buffers
        assert {k: v.data_ptr() for k, v in pool.buffers.items()} == first
        train(model, opt, data("cpu", ((4, 16),)))  # larger: grown
        assert model.strata.host_pinned_extra_bytes() == 3 * 4 * 16 * 64 * 4
    finally:
        model.strata.close()
    assert pool.nbytes == 0  # closed with the session


# ---------------------------------------------------------------------------------------------
# The automatic decision: the library's step plan (its rule's cases are C++ unit tests,
# tests/unit/test_step_plan.cpp); here, what strata.torch measures reaches it and its choice is
# executed.

GB = 1 << 30


def recording_plans(monkeypatch):
    """Every step plan the spiller asks for: (its blocks, its profile fields, the plan)."""
    from strata import step_plan
    real, calls = step_plan.plan_step, []

    def recording(blocks, intervals=(), **fields):
        plan = real(blocks, intervals, **fields)
        calls.append((blocks, fields, plan))
        return plan

    monkeypatch.setattr(step_plan, "plan_step", recording)
    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_automatic_spill_when_the_device_looks_short(monkeypatch, no_tf32):
    """On a GPU made to look nearly full (mem_get_info reports what torch holds plus a little),
    the automatic mode spills; the run is bit-identical to one that does not."""
    batches = data("cuda")
    kept, _, _, _ = strata_run(hf_llama, "cuda", False, batches)
    real = torch.cuda.mem_get_info

    def short(device=None):
        free, total = real(device)
        return min(free, 1 << 20), total

    monkeypatch.setattr(torch.cuda, "mem_get_info", short)
    spilled, count, pinned, placement = strata_run(hf_llama, "cuda", None, batches)
    assert count > 0 and pinned > 0, placement
    assert "block checkpoints spilled" in placement
    assert_bit_identical(spilled, kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_buffers_on_a_gpu_are_page_locked_at_their_size():
    """On a GPU the host copies are page-locked (asynchronous copies), registered at the
    checkpoint's exact size rather than torch's power-of-two pinned blocks, and unregistered
    when the session closes."""
    model = st.offload(hf_llama("cuda"), device="cuda", resident_blocks=0,
                       spill_checkpoints=True)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        train(model, opt, data("cuda", ((3, 24),)))
        pool = model.strata.spill.pool
        assert sorted(pool.buffers) == [0, 1, 2]
        for buf in pool.buffers.values():
            assert buf.is_pinned() and buf.numel() == 3 * 24 * 64 * 4
        assert model.strata.spill.spilled_total == 3
    finally:
        model.strata.close()
    assert pool.nbytes == 0


class _Block(torch.nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden,
                                                                                   hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.fixture
def device_memory(monkeypatch):
    """torch.cuda's memory queries, made up: `memory` says what the device has (the spiller is
    told it is on CUDA; only its decision runs, on the CPU)."""
    memory = {"total": 100 * GB, "free": 50 * GB, "reserved": 10 * GB, "allocated": 40 * GB}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda *a: (memory["free"], memory["total"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("Properties", (), {"total_memory": memory["total"]}))
    return memory


def automatic_spiller(blocks=8):
    from strata.torch.activations.keeper import ActivationKeeper
    spiller = _spill.Spiller(torch.device("cpu"), None,
                             ActivationKeeper(torch.device("cpu"), []), blocks)
    spiller.cuda = True  # decided as on a GPU; the buffers stay ordinary host memory
    return spiller


def test_the_automatic_decision_follows_the_batch(device_memory):
    """Decided at the first forward pass from its batch, kept while the batch does not grow,
    made again for a larger batch or when the forward pass starts with more memory held."""
    block = _Block()
    spiller = automatic_spiller()
    small = torch.zeros(2, 16, 64)
    # 60 GB usable, a margin of 4 or 10 (with or without expandable segments), 40 held: 10
    # GB or more left for checkpoints of a few KB: nothing spills.
    spiller.forward_begins(block.forward, block, (small,), {})
    assert (spiller.count, spiller.decisions, spiller.tokens) == (0, 1, 32)
    spiller.forward_begins(block.forward, block, (small,), {})
    assert spiller.decisions == 1  # the same batch: not decided again
    # A larger batch with the device nearly full: decided again, and every block spills.
    device_memory["allocated"] = device_memory["free"] + device_memory["reserved"]
    large = torch.zeros(4, 16, 64)
    spiller.forward_begins(block.forward, block, (large,), {})
    assert (spiller.decisions, spiller.tokens) == (2, 64)
    assert spiller.count == 8 and not spiller.fits
    assert spiller.host_bytes == 8 * large.numel() * 4
    assert "8 of 8 block checkpoints spilled" in spiller.describe()
    assert "predicted short even so" in spiller.note()
    # The smaller batch again, with the memory held the same: the decision stands.
    spiller.forward_begins(block.forward, block, (small,), {})
    assert spiller.decisions == 2
    spiller.close()


def test_the_automatic_decision_spills_what_the_prediction_needs(device_memory, monkeypatch):
    """The prediction's parts reach the step plan: what torch holds, the grads to come, every
    block, a checkpoint's bytes, the block's measured saved bytes, the device as torch sees
    it; the plan's choice is what spills. The device made short: 40 GB held, 60 usable, the
    checkpoints 16 GB each (as the profile says; the tensor itself is small)."""
    block = _Block()
    spiller = automatic_spiller(blocks=4)
    x = torch.zeros(2, 16, 64)
    ckpt = x.numel() * 4
    calls = recording_plans(monkeypatch)
    grad_owner = torch.nn.Parameter(torch.zeros(1000))
    spiller.model_params = [grad_owner]
    spiller.forward_begins(block.forward, block, (x,), {})
    (blocks, fields, plan), = calls
    assert len(blocks) == 4 and all(b.keep == "recompute" for b in blocks)
    assert fields["checkpoint_bytes"] == ckpt and fields["tokens"] == 32
    assert fields["in_use_bytes"] == 40 * GB  # held
    assert fields["backward_grad_bytes"] == 4000  # the grad the backward pass will allocate
    saved = spiller.measured[32]
    assert saved and fields["block_saved_bytes"] == saved and fields["block_saved_measured"]
    assert fields["device_free_bytes"] + fields["framework_held_bytes"] == 60 * GB
    assert plan.checkpoints_planned and plan.spilled_checkpoints == 0  # a few KB each: fits
    assert spiller.count == 0 and spiller.fits
    # Short: 58 GB held of 60 usable, less the margin (4 or 10): every block spills and the
    # step is predicted short even so; the spiller reserves what the plan chose.
    device_memory["allocated"] = 58 * GB
    spiller.forward_begins(block.forward, block, (torch.zeros(2, 16, 64),), {})
    assert len(calls) == 2
    plan = calls[1][2]
    assert plan.spilled_checkpoints == 4 and not plan.fits
    assert spiller.count == 4 and not spiller.fits
    assert sorted(spiller.pool.buffers) == [0, 1, 2, 3]
    spiller.close()


def test_paged_state_leaving_is_counted_once(device_memory, monkeypatch):
    """The resident optimizer state on its way to host memory at the forward pass's start
    (strata.torch._paging) reaches the plan as leaving bytes: gone by the loss, it comes back
    as the backward pass has room for it, so it takes the working set's place in the
    prediction (the larger of the two), not a share beside it (counted in full, an 8B's 31 GB
    at 148 x 1024 made every block spill and still predicted no fit). The reserve the copies
    back leave is the plan's: the working set, the restores in flight and the margin."""
    block = _Block()
    spiller = automatic_spiller(blocks=4)
    x = torch.zeros(2, 16, 64)
    assert spiller.backward_reserve() is None  # no decision yet
    calls = recording_plans(monkeypatch)
    spiller.leaving = lambda: 30 * GB
    spiller.forward_begins(block.forward, block, (x,), {})
    (_, fields, plan), = calls
    assert fields["leaving_bytes"] == 30 * GB and fields["in_use_bytes"] == 40 * GB
    # Nothing spills (40 - 30 held, 30 coming back in the working set's place, 60 usable):
    # the reserve is one block's working set (its saved bytes x 1.25 and its input's and
    # output's grads) and the margin; the state's own copies are what it is reserved against.
    assert plan.spilled_checkpoints == 0 and plan.fits
    ckpt = x.numel() * 4
    assert spiller.backward_reserve() == plan.backward_reserve_bytes == \
        int(spiller.measured[32] * 1.25) + 2 * ckpt + plan.margin_bytes
    spiller.close()


def test_automatic_mode_spills_nothing_inside_a_checkpoint(device_memory):
    """Inside torch.utils.checkpoint (Hugging Face gradient checkpointing around the blocks)
    the checkpoint keeps each block's input on the device: the automatic mode spills nothing
    there (no memory to save), and says so to an out-of-memory error; outside, it spills."""
    from torch.utils.checkpoint import checkpoint
    spiller = automatic_spiller(blocks=2)
    spiller.count = 2
    x = torch.zeros(2, 16, 64, requires_grad=True)
    used = []

    def block(t):
        hooks = spiller.saving(0, (t,), {})
        used.append(hooks)
        with hooks:
            return t * 2

    block(x)
    assert used[-1] is not _spill._NO_HOOKS and not spiller.inside_checkpoint
    checkpoint(block, x, use_reentrant=False)
    assert used[-1] is _spill._NO_HOOKS and spiller.inside_checkpoint
    assert "gradient_checkpointing_disable" in spiller.note()
    spiller.close()


@pytest.mark.parametrize("where", ["module", "global"])
def test_the_decision_runs_no_user_hook(where, device_memory):
    """The automatic decision measures the first block's forward on fake tensors: a
    prediction, not a forward pass of the model's, so the user's forward hooks (a module's
    inside the block, or a global one) must not see it. A counting hook counts as many calls
    as in the same loop without the decision (a review found the prediction counted too)."""
    seen = {}
    for decide in (False, True):
        model = st.offload(hf_llama("cpu"), device="cpu", resident_blocks=0,
                           spill_checkpoints=None)
        try:
            model.strata.allow_inner_hooks = True  # the hook only observes
            if decide:
                model.strata.spill.cuda = True  # decided as on a GPU (device_memory: roomy)
            mlp, calls = model.model.layers[0].mlp, []
            if where == "module":
                handle = mlp.register_forward_hook(lambda *a: calls.append(1))
            else:
                handle = torch.nn.modules.module.register_module_forward_hook(
                    lambda m, *a: calls.append(1) if m is mlp else None)
            try:
                opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
                # A larger batch in the second step: decided (and measured) again.
                train(model, opt, data("cpu", ((2, 16), (4, 16))))
            finally:
                handle.remove()
            seen[decide] = len(calls), model.strata.spill.decisions, \
                sorted(model.strata.spill.measured)
        finally:
            model.strata.close()
    assert seen[False][1] == 0 and seen[True][1] == 2 and seen[True][2] == [64]
    assert seen[True][0] == seen[False][0] > 0, seen


# --- checkpoint groups: inputs dropped and regenerated (strata.torch._regenerate) -------------

def grouped_run(build, device, group, batches, offload_kwargs=None, hook=None, **loop):
    """strata_run with every block's checkpoint spilled and, with `group`, the library's
    grouping into `group` blocks (the inputs of a group's other blocks dropped in the forward
    pass and regenerated in the backward pass). Also: the regenerations made, which block
    inputs were alive after the first forward pass, and the plan's groups."""
    import gc
    import weakref
    model = build(device)
    kwargs = {"resident_blocks": 0, **(offload_kwargs or {})}
    model = st.offload(model, device=device, spill_checkpoints=True, **kwargs)
    spill = model.strata.spill
    spill.forced_group = group
    alive = []
    refs = []
    if hook is not None:
        hook(model)
    for block in tpm.blocks_of(model):
        block.register_forward_pre_hook(
            lambda m, a, k: refs.append(weakref.ref(a[0] if a else k["hidden_states"])),
            with_kwargs=True)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        original = model.forward

        def forward(*a, **k):  # after the first forward pass: which block inputs still live
            out = original(*a, **k)
            if not alive:
                gc.collect()
                alive.extend(r() is not None for r in refs)
            return out
        model.forward = forward
        out = train(model, opt, batches, **loop)
        if group:  # placement() says so
            assert "one per group of up to %d blocks" % group in model.strata.placement()
        return out, spill.regen.regenerated_total, alive, spill.regen.starts
    finally:
        model.strata.close()


GROUP_CASES = {
    "hf": dict(build=hf_llama),
    "gpt2_dropout": dict(build=lambda device: tpm.build("gpt2", layers=5, dropout=0.1).train().to(
        device)),
    "accumulation": dict(build=hf_llama, loop=dict(accumulate=2)),
    "resident_blocks": dict(build=hf_llama, offload_kwargs=dict(resident_blocks=1)),
    "shape_changes": dict(build=hf_llama, shapes=((2, 16), (3, 24), (1, 8), (3, 24))),
    "raises_midway": dict(build=hf_llama, shapes=((2, 16),) * 5, loop=dict(fail_at=2)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("case", sorted(GROUP_CASES))
def test_grouped_checkpoints_train_bit_for_bit(case, group, device, no_tf32):
    """One checkpoint per group of blocks, the others' inputs regenerated in the backward pass:
    the same losses, grads and weights as one checkpoint per block, bit for bit (the re-run
    forward passes replay the RNG, autocast and module state), and plain PyTorch's within the
    parity tolerances; the dropped inputs are gone from memory after the forward pass."""
    spec = GROUP_CASES[case]
    layers = 5
    build = spec["build"]
    if build is hf_llama:
        build = lambda device: hf_llama(device, layers=layers)  # noqa: E731
    batches = data(device, spec.get("shapes", ((2, 16),) * STEPS))
    loop = spec.get("loop", {})
    common = dict(offload_kwargs=spec.get("offload_kwargs"), **loop)
    resident = (spec.get("offload_kwargs") or {}).get("resident_blocks", 0)
    grouped, made, alive, starts = grouped_run(build, device, group, batches, **common)
    single, none, alive_single, no_starts = grouped_run(build, device, None, batches, **common)
    # Spilled to host memory, a block's input leaves the device (nothing else holds it: the
    # regression was the recompute's arguments and the save hook's closure keeping it).
    assert alive_single and not any(alive_single[resident:]), alive_single
    plain = plain_run(build, device, batches, **loop)
    # The library's groups: runs of streamed blocks from the first streamed one.
    assert no_starts is None and none == 0
    assert starts == [i if i < resident else resident + (i - resident) // group * group
                      for i in range(layers)]
    dropped = [i for i in range(layers) if starts[i] != i]
    assert made >= len(dropped) and dropped
    assert alive and not any(alive[i] for i in dropped), alive
    assert_bit_identical(grouped, single)
    assert_close_to_plain(grouped, plain)


def test_an_input_changed_between_blocks_is_kept_not_regenerated():
    """A model that transforms the hidden states between two blocks (a pre-hook returning new
    arguments): that block's input is not the previous block's output, so it keeps it (and
    the result is the same bit for bit)."""
    def double_into_block_two(model):
        model.model.layers[2].register_forward_pre_hook(
            lambda m, args, kwargs: ((args[0] * 1.0,) + args[1:], kwargs)
            if args else (args, dict(kwargs, hidden_states=kwargs["hidden_states"] * 1.0)),
            with_kwargs=True)
    build = lambda device: hf_llama(device, layers=4)  # noqa: E731
    batches = data("cpu")
    grouped, made, alive, starts = grouped_run(build, "cpu", 4, batches,
                                               hook=double_into_block_two)
    single, _, _, _ = grouped_run(build, "cpu", None, batches, hook=double_into_block_two)
    assert starts == [0, 0, 0, 0]
    assert alive[1] is False and alive[2] is True and alive[3] is False, alive
    assert_bit_identical(grouped, single)
    # Block 3's input regenerated from block 2's kept one (one re-run), block 1's from block 0.
    assert made == 2 * STEPS


def test_the_plan_says_it_grouped():
    """The library's dump names the grouping and why (a profile short of host room)."""
    from strata import step_plan
    blocks = [step_plan.Block(1000, residency="streamed")] * 16
    plan = step_plan.plan_step(
        blocks, plan_checkpoints=True, tokens=1024, checkpoint_bytes=1 << 30,
        block_saved_bytes=4 << 30, block_saved_measured=True, device_total_bytes=40 << 30,
        device_free_bytes=40 << 30, in_use_bytes=24 << 30, host_room_bytes=6 << 30,
        max_group_blocks=4)
    assert plan.checkpoint_group_blocks == 3 and plan.fits
    assert plan.spilled_checkpoint_bytes == 6 << 30
    assert [b["group_start"] for b in plan.blocks] == [i // 3 * 3 for i in range(16)]
    assert "one per group of 3" in plan.text and "from block 12" in plan.text


def test_a_decision_made_again_frees_the_buffers_it_no_longer_spills():
    """Decided again with other homes (here groups of 2 after one checkpoint per block), the
    buffers of blocks that no longer spill are freed before the new ones are reserved: the
    plan counted their room as the new buffers' (kept, they made the host refuse those)."""
    from strata.torch.activations.keeper import ActivationKeeper
    spiller = _spill.Spiller(torch.device("cpu"), True,
                             ActivationKeeper(torch.device("cpu"), []), 8)
    block = _Block()
    x = torch.zeros(2, 16, 64)
    spiller.forward_begins(block.forward, block, (x,), {})
    assert sorted(spiller.pool.buffers) == list(range(8))
    spiller.forced_group = 2
    spiller.forward_begins(block.forward, block, (x,), {})
    assert spiller.spilled == (0, 2, 4, 6)
    assert sorted(spiller.pool.buffers) == [0, 2, 4, 6]
    assert spiller.regen.starts == [0, 0, 2, 2, 4, 4, 6, 6]
    spiller.close()


def test_the_plans_state_tier_advice_reaches_the_report(device_memory, monkeypatch):
    """The session's optimizer state in DRAM (its staging slots aside) and the NVMe tier's room
    reach the step profile; where the plan advises state on NVMe (the host's room short of the
    checkpoints the step wants), placement()'s line and an out-of-memory note say how much and
    why strata.torch did not move it (placed at offload, before the batch). The step made
    short as in test_the_plan_says_it_grouped: 16 blocks of 1 GiB checkpoints, 6 GiB of room."""
    import weakref

    from strata import step_plan
    from strata.torch import _spill_plan

    class Optimizer:
        def stats(self):
            return {"state_bytes": 21 * GB, "staging_bytes": GB}

    class Runtime:
        def capabilities(self):
            return type("Caps", (), {"tiers_available": [1, 1, 1]})

        def tier_usage(self, tier):
            assert tier == "nvme"
            return {"budget": 120 * GB, "used": 20 * GB}

    class Session:
        optimizer, runtime = Optimizer(), Runtime()

    session = Session()
    real, calls = step_plan.plan_step, []

    def short_of_room(blocks, intervals=(), **fields):
        if not fields.get("plan_checkpoints"):  # (the spiller's defaults)
            return real(blocks, intervals, **fields)
        calls.append(dict(fields))
        fields.update(tokens=1024, checkpoint_bytes=GB, block_saved_bytes=4 * GB,
                      block_saved_measured=True, device_total_bytes=40 * GB,
                      device_free_bytes=40 * GB, framework_held_bytes=0, in_use_bytes=24 * GB,
                      host_room_bytes=6 * GB, max_group_blocks=1, backward_grad_bytes=0,
                      leaving_bytes=0, mlp_token_bytes=0, vocab=0, hidden=0)
        return real(blocks, intervals, **fields)

    monkeypatch.setattr(step_plan, "plan_step", short_of_room)
    spiller = automatic_spiller(blocks=16)
    spiller.session = weakref.ref(session)
    block = _Block()
    spiller.forward_begins(block.forward, block, (torch.zeros(2, 16, 64),), {})
    fields, = calls
    assert fields["state_dram_bytes"] == 20 * GB and fields["nvme_free_bytes"] == 100 * GB
    assert spiller.state_advice == (8 * GB, 1)
    said = spiller.describe()
    assert "advises 8.00 GiB of the streamed blocks' optimizer state on NVMe" in said
    assert "one checkpoint per block" in said and "state_placement='nvme'" in said
    assert "advises 8.00 GiB" in spiller.note()
    # Without a session (a spiller alone) nothing is counted and nothing advised.
    assert _spill_plan.state_figures(None) == {}
    spiller.session = lambda: None
    calls.clear()
    spiller.decisions = 0
    spiller.forward_begins(block.forward, block, (torch.zeros(2, 16, 64),), {})
    assert "state_dram_bytes" not in calls[0] and spiller.state_advice is None
    assert "optimizer state" not in spiller.describe()
    spiller.close()
