"""The DRAM arena's two parts (C ABI 1.5, dram_pinned_bytes) and the executor's copies: a
layer's weights laid out back to back go to the device as one span, except where a weight
fell back into the unpinned part; CUDA refuses a copy whose host range spans a registered and
an unregistered range, so such a layer's weights travel one copy each."""
from strata import core

MiB = 1 << 20


def plan_span(rt, weights):
    ex = core.Executor(rt, [{"name": "l0", "weights": weights, "grads": []}])
    try:
        line = [s for s in ex.plan_text().splitlines() if s.strip().startswith("l0 ")][0]
        return line.split()[-1]
    finally:
        ex.close()


def test_weights_across_the_pinned_boundary_are_not_one_span():
    rt = core.Runtime(backend="host", hbm_budget=256 * MiB, dram_budget=64 * MiB,
                      dram_pinned=8 * MiB)
    try:
        ws = [rt.register("w%d" % i, [n * MiB], "uint8", "weight") for i, n in enumerate((6, 1))]
        assert plan_span(rt, ws) == "yes"  # both in the pinned part, back to back
        # The pinned part is full: the next weight falls back to the unpinned part, whose
        # first block starts at the boundary, right after w1.
        ws.append(rt.register("w2", [2 * MiB], "uint8", "weight"))
        assert ws[2].data_pointer() - ws[0].data_pointer() == 8 * MiB
        assert rt.tier_usage("dram")["dram_fallbacks"] == 1
        assert plan_span(rt, ws) == "no"
    finally:
        rt.close()
