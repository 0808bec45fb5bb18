"""The Python package over the C ABI: handles, data in and out, DLPack both ways, and errors
that carry the status and the library's message."""
import pytest

import strata

MiB = 1 << 20


@pytest.fixture()
def rt():
    r = strata.Runtime(backend="host", hbm_budget=16 * MiB, dram_budget=16 * MiB)
    yield r
    r.close()


def test_register_write_read(rt):
    t = rt.register("w", [2, 3], "float32", "weight")
    assert t.name == "w" and t.nbytes == 24
    t.write(bytes(range(24)))
    assert t.read() == bytes(range(24))
    assert t.read(4, offset=20) == bytes([20, 21, 22, 23])
    assert rt.tier_usage("dram")["tensors"] == 1


def test_dram_fault_threads_reach_the_runtime():
    """core.Runtime(dram_fault_threads=) is the config's field: the capabilities report the
    threads that faulted the arena in and its set-up times (pinning overlaps the fault-in, so
    dram_pin_seconds is only what it added after it)."""
    with strata.Runtime(backend="host", hbm_budget=16 * MiB, dram_budget=16 * MiB,
                        dram_fault_threads=3) as r:
        caps = r.capabilities()
        assert caps.dram_fault_threads == 3
        assert caps.dram_fault_seconds > 0 and caps.dram_pin_seconds >= 0
    with strata.Runtime(backend="host", hbm_budget=16 * MiB, dram_budget=16 * MiB) as r:
        assert r.capabilities().dram_fault_threads >= 1  # 0 asks for one per core


def test_errors_carry_status_and_message(rt):
    rt.register("dup", [4], "float32")
    with pytest.raises(strata.StrataError) as e:
        rt.register("dup", [4], "float32")
    assert e.value.status_name == "ALREADY_EXISTS"
    assert "dup" in e.value.message
    with pytest.raises(strata.OutOfMemory, match="cannot allocate"):
        rt.register("big", [64 * MiB], "uint8")
    t = rt.register("small", [4], "uint8")
    with pytest.raises(strata.InvalidArgument):
        t.write(bytes(8))  # past its end


def test_dlpack_is_zero_copy(rt):
    torch = pytest.importorskip("torch")
    t = rt.register("x", [4], "float32")
    t.write(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    x = torch.from_dlpack(t)
    assert t.__dlpack_device__() == (1, 0)  # kDLCPU on the host backend
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    x.mul_(2)  # writes the runtime's memory
    assert torch.frombuffer(bytearray(t.read()), dtype=torch.float32).tolist() == [0, 2, 4, 6]


def test_executor_views_and_misuse(rt):
    torch = pytest.importorskip("torch")
    w = rt.register("l0.w", [8], "float32", "weight")
    g = rt.register("l0.g", [8], "float32", "grad")
    w.write(torch.ones(8).numpy().tobytes())
    ex = strata.Executor(rt, [{"weights": [w], "grads": [g]}])
    with pytest.raises(strata.InvalidState, match="step_begin"):
        ex.acquire(0, strata.FORWARD)
    ex.step_begin()
    ex.acquire(0, strata.FORWARD)
    view = torch.from_dlpack(ex.view(0, strata.FORWARD, strata.VIEW_WEIGHT, 0))
    assert view.tolist() == [1.0] * 8
    with pytest.raises(strata.InvalidArgument, match="backward"):
        ex.view(0, strata.FORWARD, strata.VIEW_GRAD, 0)
    del view
    ex.release(0, strata.FORWARD)
    ex.acquire(0, strata.BACKWARD)
    torch.from_dlpack(ex.view(0, strata.BACKWARD, strata.VIEW_GRAD, 0)).fill_(0.5)
    with pytest.raises(strata.InvalidArgument, match="bytes"):
        ex.write_view(0, strata.BACKWARD, strata.VIEW_GRAD, 0, 1, 3)  # 3 of 32 bytes
    ex.release(0, strata.BACKWARD)
    ex.step_end()
    assert torch.frombuffer(bytearray(g.read()), dtype=torch.float32).tolist() == [0.5] * 8
    # The host-wait acquire (JAX's) and write_view (immutable arrays) on the next step.
    ex.step_begin()
    ex.acquire(0, strata.FORWARD, host_wait=True)
    ex.release(0, strata.FORWARD)
    ex.acquire(0, strata.BACKWARD, host_wait=True)
    grads = torch.full((8,), 0.25)
    ex.write_view(0, strata.BACKWARD, strata.VIEW_GRAD, 0, grads.data_ptr(), 32)
    ex.release(0, strata.BACKWARD)
    ex.step_end()
    assert torch.frombuffer(bytearray(g.read()), dtype=torch.float32).tolist() == [0.25] * 8
    ex.step_begin()
    ex.acquire(0, strata.FORWARD)
    ex.release(0, strata.FORWARD)
    ex.acquire(0, strata.BACKWARD)
    ex.release(0, strata.BACKWARD)
    ex.step_end()
    # Grad buffers start at zero each backward pass: nothing written, zeros land.
    assert torch.frombuffer(bytearray(g.read()), dtype=torch.float32).tolist() == [0.0] * 8


def test_grad_sums_in_place(rt):
    """Optimizer.add_param(grad_sum="in_place") (strata_param_desc_t.grad_sum): the param's
    grad is an fp32 tensor in HBM that the framework adds each backward pass into, zeroed at
    the backward load only where the param holds no grad; write_view on it is refused (a
    copy would drop the sum); a bf16 or DRAM grad cannot be one."""
    torch = pytest.importorskip("torch")
    w = rt.register("w", [8], "float32", "weight")
    g = rt.register("w.grad", [8], "float32", "grad", "hbm")
    opt = strata.Optimizer(rt, "sgd", update_mode="explicit", lr=0.5)
    with pytest.raises(ValueError, match="grad_sum must be one of"):
        opt.add_param(w, g, grad_sum="inplace")
    for name, dtype, tier in (("bf16", "bfloat16", "hbm"), ("dram", "float32", "dram")):
        w2 = rt.register("w." + name, [8], dtype, "weight")
        g2 = rt.register("w.%s.grad" % name, [8], dtype, "grad", tier)
        with pytest.raises(strata.InvalidArgument):
            opt.add_param(w2, g2, grad_sum="in_place")
    opt.add_param(w, g, grad_sum="in_place")
    ex = strata.Executor(rt, [{"weights": [w], "grads": [g]}])
    opt.attach(ex)
    for k in (1, 2):  # two backward passes, no zeroing between: the sum of both
        ex.step_begin()
        ex.acquire(0, strata.FORWARD)
        ex.release(0, strata.FORWARD)
        ex.acquire(0, strata.BACKWARD)
        torch.from_dlpack(ex.view(0, strata.BACKWARD, strata.VIEW_GRAD, 0)).add_(float(k))
        with pytest.raises(strata.InvalidState):
            ex.write_view(0, strata.BACKWARD, strata.VIEW_GRAD, 0, w.data_pointer(), 32)
        ex.release(0, strata.BACKWARD)
        ex.step_end()
    got = torch.empty(8)
    opt.grad_read(w, got.data_ptr(), 8)
    assert got.tolist() == [3.0] * 8
    assert opt.grad_info(w)[:2] == (True, 8 * 9.0)


def test_optimizer_settings_are_checked(rt):
    with pytest.raises(ValueError, match="learning_rate"):
        strata.Optimizer(rt, "adamw", learning_rate=1.0)
    with pytest.raises(strata.InvalidArgument, match="beta1"):
        strata.Optimizer(rt, "adamw", beta1=2.0)


def test_group_hyperparameters_round_trip(rt):
    """Optimizer.set_group with betas and eps sets every hyperparameter of the group
    (strata_optimizer_set_group_hyperparams); without them only lr and weight decay change."""
    opt = strata.Optimizer(rt, "adamw", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    fresh = opt.group(5)  # not created yet: reads as group 0
    assert (fresh.beta1, fresh.eps) == (pytest.approx(0.9), pytest.approx(1e-8))
    opt.set_group(1, 2e-3, 0.1, betas=(0.85, 0.99), eps=1e-6)
    g = opt.group(1)
    assert (g.lr, g.weight_decay, g.beta1, g.beta2, g.eps) == (
        pytest.approx(2e-3), pytest.approx(0.1), pytest.approx(0.85), pytest.approx(0.99),
        pytest.approx(1e-6))
    opt.set_group(1, 3e-3, 0.0)
    g = opt.group(1)
    assert (g.lr, g.beta1, g.eps) == (pytest.approx(3e-3), pytest.approx(0.85),
                                      pytest.approx(1e-6))
    with pytest.raises(strata.InvalidArgument, match="beta2"):
        opt.set_group(1, 1e-3, 0.0, betas=(0.9, 1.0))
    assert opt.group(1).beta2 == pytest.approx(0.99)


def test_optimizer_defaults_are_torchs():
    """strata_optimizer_config_init's defaults (the core's OptimizerConfig, their only copy) are
    torch.optim.AdamW's and torch.optim.SGD's, read from torch itself."""
    torch = pytest.importorskip("torch")
    import ctypes
    from strata import _lib

    param = [torch.zeros(1, requires_grad=True)]
    for kind, torch_optimizer in ((0, torch.optim.AdamW), (1, torch.optim.SGD)):
        c = _lib.OptimizerConfig()
        assert _lib.lib.strata_optimizer_config_init(kind, ctypes.byref(c)) == 0
        d = torch_optimizer(param).defaults
        assert c.kind == kind
        assert c.lr == pytest.approx(d["lr"], rel=1e-6)
        assert c.weight_decay == pytest.approx(d["weight_decay"], rel=1e-6), torch_optimizer
        if kind == 0:
            assert (c.beta1, c.beta2) == pytest.approx(d["betas"], rel=1e-6)
            assert c.eps == pytest.approx(d["eps"], rel=1e-6)
        else:
            assert (c.momentum, c.dampening, c.nesterov) == (d["momentum"], d["dampening"],
                                                             int(d["nesterov"]))
        assert (c.max_grad_norm, c.loss_scale, c.dynamic_loss_scale) == (0, 1, 0)
        assert (c.accumulation_steps, c.threads, c.update_mode) == (1, 0, 0)
        assert 0 < c.struct_size <= ctypes.sizeof(c)  # the header's macro, set by the library


def test_core_sizing_is_the_layout_query():
    """strata.core's sizing functions are strata_layout_query's numbers: each agrees with the
    query's fields, and with the figures the Python copies computed before the query existed
    (frozen here, the regression guard that the move changed nothing but what the changelog
    of 1.3 names)."""
    core = strata.core
    page = 4096

    def block(n):  # an arena block and the page a layout adds
        return -(-n // page) * page + page

    blocks, frozen = [[1000, 70001], [12345]], [[3000], []]
    for element, layout, grads in ((2, "separate", "dram"), (2, "split", "hbm"),
                                   (4, "separate", "dram"), (4, "separate", "hbm")):
        sizes = core.layout_sizes(blocks, element, frozen, layout, grads)
        layers = core.placement_layers(blocks, element, frozen, master_layout=layout,
                                       grads=grads)
        per = {(2, "separate"): 12, (2, "split"): 10, (4, "separate"): 8}[element, layout]
        assert core.state_bytes_per_param(element, layout) == per == \
            sizes["state_bytes_per_element"]
        for layer, q, b, f in zip(layers, sizes["layers"], blocks, frozen):
            for key in ("weight_bytes", "grad_bytes", "state_bytes", "update_elements"):
                assert layer[key] == q[key], key
            assert layer["grad_tier"] == grads and layer["state_tier"] == "choose"
            # The figures the Python copies computed (core.py before 1.3).
            assert layer["weight_bytes"] == sum(block(n * element) for n in b + f)
            assert layer["state_bytes"] == sum(per * n + per * n // 64 + 3 * 8192 for n in b)
            fetch = block(sum(-(-n * element // 64) * 64 for n in b))
            assert layer["grad_bytes"] == (sum(block(n * element) for n in b)
                                           if grads == "dram" else fetch)
        fetch = core.grad_fetch_bytes(blocks, element)
        assert fetch == max(block(sum(-(-n * element // 64) * 64 for n in b)) for b in blocks)
        assert (sizes["grad_fetch_bytes"] == fetch) == (grads == "hbm")
        for slots in (0, 4):
            full = core.full_dram(layers, slots)
            grad_sum = sum(l["grad_bytes"] for l in layers) if grads == "dram" else fetch
            assert full == (sum(l["weight_bytes"] + l["state_bytes"] for l in layers) + grad_sum
                            + slots * max(l["state_bytes"] for l in layers)
                            + core.NVME_DRAM_MARGIN)
            assert full == core.layout_totals(layers, slots)["dram_bytes"]
        assert core.NVME_DRAM_MARGIN == 16 << 20
        # The gradient accumulators: an fp32 sum per trainable element, each tensor's pages and
        # a page (what the optimizer places them by).
        accum = sum(block(4 * n) for b in blocks for n in b)
        assert sizes["accum_bytes"] == accum == core.accum_bytes(blocks, element)
        # The NVMe tier's margins: 64 MiB a block and 5%, as strata.torch reserves them; the
        # tier holds the accumulators too.
        totals = core.layout_totals(layers)
        spillable = sum(l["weight_bytes"] + l["state_bytes"] for l in layers) + accum
        margin = (64 << 20) * len(layers)
        assert totals["nvme_margin_bytes"] == margin
        assert totals["nvme_bytes"] == -(-spillable * 105 // 100) + margin
        assert totals["nvme_placeable_bytes"] == (totals["nvme_bytes"] - margin) * 100 // 105
        budget = 3 * margin + 12345
        assert core.layout_totals(layers, nvme_budget=budget)["nvme_placeable_bytes"] == \
            (budget - margin) * 100 // 105
        assert core.layout_totals(layers, nvme_budget=margin)["nvme_placeable_bytes"] == 0
        # Grads summed in place: fp32 in HBM whatever the weights' dtype, read through a
        # buffer sized for fp32, and no accumulators.
        sums = core.layout_sizes(blocks, element, frozen, layout, "hbm", grad_sum="in_place")
        assert sums["accum_bytes"] == 0 and sums["grad_dram_bytes"] == 0
        assert sums["grad_hbm_bytes"] == sum(4 * sum(b) + 4 * sum(b) // 100 + (64 << 10)
                                             for b in blocks)
        assert sums["grad_fetch_bytes"] == core.grad_fetch_bytes(blocks, element, "in_place") \
            == max(block(sum(-(-n * 4 // 64) * 64 for n in b)) for b in blocks)
        assert core.accum_bytes(blocks, element, "hbm", "in_place") == 0
        sum_layers = core.placement_layers(blocks, element, frozen, master_layout=layout,
                                           grads="hbm", grad_sum="in_place")
        assert [l["grad_bytes"] for l in sum_layers] == \
            [q["grad_bytes"] for q in sums["layers"]]
        assert core.layout_totals(sum_layers)["accum_bytes"] == 0
        with pytest.raises(ValueError, match="different element sizes"):
            core.layout_totals(layers + sum_layers)
    # The default budgets without NVMe, and the grads' HBM.
    counts = [5 << 20, 7 << 20]
    for layout, grads in (("separate", "dram"), ("split", "hbm")):
        hbm, dram = core.streaming_budgets(counts, 2, layout, grads)
        per = 2 + (2 if grads == "dram" else 0) + (12 if layout == "separate" else 10)
        expected = sum(counts) * per
        expected += expected // 50 + (256 << 20)
        want_hbm = 8 * 2 * max(counts) + (64 << 20)
        if grads == "hbm":
            expected += core.grad_fetch_bytes([[n] for n in counts], 2) + (1 << 20)
            want_hbm += core.grads_hbm_bytes(counts, 2)
        assert (hbm, dram) == (want_hbm, expected)
    assert core.grads_hbm_bytes(counts, 2) == sum(n * 2 + n * 2 // 100 + (64 << 10)
                                                  for n in counts)
    hbm, _ = core.streaming_budgets(counts, 2, "split", "hbm", "in_place")
    assert hbm == 8 * 2 * max(counts) + (64 << 20) + core.grads_hbm_bytes(counts, 2, "in_place")
    assert core.grads_hbm_bytes(counts, 2, "in_place") == sum(n * 4 + n * 4 // 100 + (64 << 10)
                                                              for n in counts)
    with pytest.raises(strata.InvalidArgument):  # in place means in HBM
        core.layout_sizes([[1]], 2, grads="dram", grad_sum="in_place")
    with pytest.raises(ValueError, match="grad_sum 'inplace' is not one of"):
        core.layout_sizes([[1]], 2, grads="hbm", grad_sum="inplace")
    with pytest.raises(ValueError, match="element_size"):
        core.layout_sizes([[1]], 8)
    with pytest.raises(strata.InvalidArgument, match="no layers"):
        core.layout_sizes([], 2)
    with pytest.raises(strata.InvalidArgument, match="2\\^44"):
        core.layout_sizes([[1 << 45]], 2)
    with pytest.raises(ValueError, match="placement_layers made"):
        core.full_dram([{"weight_bytes": 1, "grad_bytes": 1, "state_bytes": 1}])
    assert core.placement_layers([], 2) == []
