"""strata.torch data parallel (issue 16) on the CPU: ranks are processes under a gloo process
group, each with its own Strata runtime (host backend), running
tests/python/support/torch_dist_worker.py.

- 2 ranks x b rows train like plain PyTorch DDP at 2 x b (losses within 1e-6, parameters 2e-6)
  and like one rank at 2b rows (losses within 1e-6; parameters within 1e-5, because DDP itself
  departs that far from one process here: a batch's grad summed in two halves rounds
  differently, and AdamW magnifies the rounding of grads near zero; measured 4.2e-6).
- 4 ranks as 2 replicas x 2 shards (processes standing in for two hosts) train like one rank.
- DataParallel(state_across_hosts=True) (issue 39): 4 ranks as 2 hosts x 2 and 2 ranks as 2
  hosts x 1, each rank with the optimizer state of half of its chunks, train like one rank and
  resume exactly; each rank's state bytes are half of HSDP's; what the option cannot do is
  refused on every rank.
- A rank that raises, is killed, or stops mid-step takes the job down: the others fail within
  the collective timeout with Strata's error instead of hanging.
- With nvme= (issue 39) 2 ranks with state, and weights, on their own NVMe files train like one
  rank and resume exactly; a rank that cannot use nvme=, or disagrees about it, is refused on
  every rank.
- The GPU path's stream ordering, which gloo (synchronous) cannot show: the layout's step over
  CUDA streams modelled by vector clocks, every access of the same memory from two streams
  ordered (hosts of one and of two GPUs, with and without the state across hosts)."""
import contextlib
import os
import types

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)
import rank_launch  # noqa: E402
import torch_dist_worker as worker  # noqa: E402
import strata.core  # noqa: E402
from strata.core import BACKWARD, FORWARD, VIEW_WEIGHT  # noqa: E402

ROWS, STEPS, CLIP = 4, 4, 0.05  # the clip binds: every step scales the grads


def launch(world, args, limit=120, grace=5.0):
    """Start `world` ranks (each forked from a forkserver that imported torch and strata.torch
    once, so a job starts in a fraction of a second instead of importing torch per rank); wait
    (at most `limit` s) for rank 0 to exit, then up to `grace` s for the rest, which are killed
    after that (as torchrun ends a job whose rank failed). Returns (exit codes, output texts,
    seconds until rank 0 exited); a rank 0 still running at `limit` is a hang and fails the
    test."""
    argv = ["--world", str(world), "--port", str(rank_launch.free_port())]
    for k, v in args.items():
        argv += [k] if v is True else [k, str(v)]
    # torch._dynamo: torch.optim.Optimizer imports it at first use, 10 s on a slow host.
    ctx = rank_launch.forkserver("torch", "torch.distributed", "torch._dynamo", "strata.torch",
                                 "torch_dist_worker")
    codes, texts, elapsed = rank_launch.launch_led_by_rank0(
        ctx, worker.entry, argv, world, args["--out"], limit, grace)
    assert elapsed < limit, "rank 0 hung for %d s:\n%s" % (limit, texts[0][-3000:])
    return codes, texts, elapsed


def assert_bf16_close(got, expected):
    """Losses within 1% and every parameter's difference within 2% of its RMS: bf16 ranks
    against one bf16 process (the sums round in another order)."""
    for g, e in zip(got["losses"], expected["losses"]):
        assert abs(g - e) <= 1e-2 * abs(e), (got["losses"], expected["losses"])
    for name, e in expected["state"].items():
        e = e.float()
        d = got["state"][name].float() - e
        assert d.pow(2).mean().sqrt() <= 2e-2 * e.pow(2).mean().sqrt(), name


def run_ranks(tmp_path, name, world, **args):
    out = str(tmp_path / name)
    options = {"--out": out, "--rows": ROWS, "--steps": STEPS, "--clip": CLIP}
    options.update({"--" + k.replace("_", "-"): v for k, v in args.items()})
    codes, texts, _ = launch(world, options)
    assert codes == [0] * world, "ranks failed: %s\n%s" % (codes, "\n".join(
        t[-2000:] for t in texts))
    return torch.load(out, weights_only=True)


def one_rank(tmp_path):
    """The reference: strata.torch in one process (no data parallelism) with every step's
    whole batch."""
    return run_ranks(tmp_path, "one.pt", 1)


def assert_close(got, expected, atol, rtol=0.0, loss_rtol=1e-6):
    for g, e in zip(got["losses"], expected["losses"]):
        assert abs(g - e) <= loss_rtol * abs(e), (got["losses"], expected["losses"])
    assert sorted(got["state"]) == sorted(expected["state"])
    for name, e in expected["state"].items():
        g = got["state"][name]
        assert g.shape == e.shape and g.dtype == e.dtype, name
        worst = ((g - e).abs() - rtol * e.abs()).max().item()
        assert worst <= atol, "%s differs by %.3g" % (name, worst)


def test_two_ranks_train_like_ddp_and_like_one_rank_with_twice_the_batch(tmp_path):
    # The ranks start from different seeds: rank 0's values are broadcast, as DDP does.
    strata2 = run_ranks(tmp_path, "strata.pt", 2)
    ddp2 = run_ranks(tmp_path, "ddp.pt", 2, mode="ddp")
    assert strata2["losses"][-1] < strata2["losses"][0] - 0.1  # it learns
    # 2e-6: with torch 2.15 (1e-6 held with earlier ones) one element of 93k, in
    # layers.0.mlp.gate_proj, differs by 1.19e-6 and the rest by < 5e-7, the losses equal at
    # every step: grads that round differently (DDP's now differ from Strata's on some norm
    # weights by 1-2 fp32 ulps), magnified by AdamW where a grad is near zero. Both sides
    # depart as far from one process (below). Not caught at any tolerance: a reduction that
    # sums instead of averaging (the clip binds every step and AdamW is scale-free).
    assert_close(strata2, ddp2, atol=2e-6, rtol=1e-6)
    one = one_rank(tmp_path)
    assert_close(strata2, one, atol=1e-5)
    # Each rank keeps optimizer state for its half of every parameter (chunks padded to 64).
    params = len(one["state"])
    assert one["elements"] <= 2 * strata2["elements"] <= one["elements"] + 2 * 64 * params


def test_elementwise_grad_changes_on_two_ranks_equal_one_rank(tmp_path):
    # clip_grad_value_ and mul_ by a mask of each parameter's shape between backward and step
    # (clip_grad_norm_ after them): each rank changes its own chunk of every streamed grad,
    # with its slice of the mask, and trains as one process with both ranks' rows does.
    strata2 = run_ranks(tmp_path, "strata.pt", 2, grad_ops=True)
    one = run_ranks(tmp_path, "one.pt", 1, grad_ops=True)
    assert_close(strata2, one, atol=1e-5)
    plain = one_rank(tmp_path)  # the changes changed the run
    assert max(abs(a - b) for a, b in zip(one["losses"][1:], plain["losses"][1:])) > 1e-4


def test_weights_loaded_without_the_optimizer_set_every_shards_masters(tmp_path):
    # st.load_checkpoint(path, model) with no optimizer under sharding: each rank sets the
    # masters of its own chunks from the loaded weights (test_torch_offload.py has the idiom
    # in one process); checked on every chunk, gathered.
    got = run_ranks(tmp_path, "weights.pt", 2, shard_size=2, dtype="bfloat16", weights_at=2)
    assert got["masters_follow"] is True


def test_weights_rank_0_loads_before_the_optimizer_reach_every_rank(tmp_path):
    # Rank 0 alone loads weights between offload and the optimizer (bf16 offload of an fp32
    # model): the values go to every rank at the build, and so must the choice of where the
    # resident masters start (rank 0 saw its parameters written, the others did not, and
    # their masters started from offload's stale fp32 copies: the ranks diverged; a review
    # found it).
    got = run_ranks(tmp_path, "rank0.pt", 2, shard_size=2, dtype="bfloat16", load_on_rank0=True)
    assert got["residents_agree"] is True


def test_bf16_with_fp32_reduction_trains_like_one_rank(tmp_path):
    # bf16 weights and grads, grads averaged in fp32 and rounded once into the bf16 chunk.
    # bf16's tolerance: the two sides' grads round to bf16 from differently formed sums, and
    # AdamW turns a flipped rounding of a small grad into a step of ~lr, so a few elements
    # differ by several ulps. Measured: losses 1.5e-4 relative, parameters' difference 0.6% of
    # their RMS (a rank's chunk left un-updated would be tens of percent).
    got = run_ranks(tmp_path, "bf16.pt", 2, dtype="bfloat16", reduce_dtype="float32")
    expected = run_ranks(tmp_path, "bf16-one.pt", 1, dtype="bfloat16")
    assert_bf16_close(got, expected)


@pytest.mark.parametrize("case", ["shards", "pieces", "shards_bf16", "shards_bf16_grads"])
def test_grads_on_the_device_train_as_grads_on_the_host(tmp_path, case):
    # offload(grads="device") under data parallelism, 3 micro-batches a step with the clip.
    # By default there (grad_dtype float32) each rank's grad chunks are fp32 sums on the
    # device, every micro-batch's reduced grads added in place: 2 ranks sharding every
    # parameter ("shards"), and 2 ranks as hosts of one GPU with the state across hosts
    # ("pieces"). The weights, losses and the clip's global norms are grads="host"'s bit for
    # bit (the same reduction in the compute dtype, the same fp32 sums), and close to plain
    # PyTorch in one process on the whole batch; each rank's DRAM holds neither the grads nor
    # accumulators (tier_usage lower by both, less the buffer the sums are read through). In
    # bf16 ("shards_bf16") the reduction stays bf16, as with grads="host" (fp32, the sums'
    # dtype, would round otherwise: not bit for bit). grad_dtype=bfloat16
    # ("shards_bf16_grads"): bf16 grad chunks on the device, accumulated in the optimizer's
    # fp32 accumulators in DRAM, bit for bit too. Fails if the reduced grads are copied into
    # the sums (a step would see its last micro-batch only) or reduced in the sums' dtype.
    args = {"rows": 6, "accumulate": 3}
    if case == "pieces":
        args.update(shard_size=1, state_across_hosts=True)
    if case.startswith("shards_bf16"):
        args["dtype"] = "bfloat16"
    device_args = {"grads": "device"}
    if case == "shards_bf16_grads":
        device_args["grad_dtype"] = "bfloat16"
    host = run_ranks(tmp_path, "host.pt", 2, **args)
    got = run_ranks(tmp_path, "device.pt", 2, **args, **device_args)
    assert host["losses"][-1] < host["losses"][0] - 0.1  # it learns
    assert len(host["norms"]) == STEPS and got["norms"] == host["norms"]
    assert got["losses"] == host["losses"]
    for name, value in host["state"].items():
        assert torch.equal(got["state"][name], value), name
    sums = case != "shards_bf16_grads"
    dtype = strata.core.DTYPES["float32" if sums else "bfloat16"]
    for h, d in zip(host["grad_memory"], got["grad_memory"]):
        assert h["grad_tiers"] == [strata.core.TIERS["dram"]] and h["accum_bytes"] > 0
        assert d["grad_tiers"] == [strata.core.TIERS["hbm"]] and d["grad_dtypes"] == [dtype]
        assert d["hbm_used"] >= d["grad_bytes"]
        saved = h["dram_used"] - d["dram_used"]
        if sums:
            assert d["accum_bytes"] == 0 and "gradient sums in place on the GPU" in d["placement"]
            # fp32 sums: the host's grads' bytes, twice them in bf16.
            assert d["grad_bytes"] == h["grad_bytes"] * (2 if "bf16" in case else 1)
            dropped, tensors = h["grad_bytes"] + h["accum_bytes"], 2 * h["grad_tensors"]
        else:
            assert d["accum_bytes"] == h["accum_bytes"] and d["grad_bytes"] == h["grad_bytes"]
            dropped, tensors = h["grad_bytes"], h["grad_tensors"]
        # The arena rounds each tensor up to 4 KiB pages; the grads on the device are read
        # through one buffer.
        assert dropped - d["fetch_bytes"] <= saved <= dropped + 4096 * tensors, (saved, h, d)
    if not case.startswith("shards_bf16"):
        plain = run_ranks(tmp_path, "plain.pt", 1, mode="ddp", rows=6)
        assert_close(got, plain, atol=1e-5)


def test_ranks_that_disagree_about_the_grads_home_are_refused_on_every_rank(tmp_path):
    # Rank 1 passes grads="host", rank 0 grads="device": offload refuses on both, naming each
    # rank's choice, before anything trains (no rank left waiting in a collective).
    options = {"--out": str(tmp_path / "disagree"), "--rows": ROWS, "--steps": 1,
               "--timeout": 20, "--grads": "device", "--grads-fault": "disagree"}
    codes, texts, _ = launch(2, options, limit=60, grace=5)
    for code, text in zip(codes, texts):
        assert code not in (0, None), text[-2000:]
        assert "ValueError: strata.torch.offload: the data-parallel ranks disagree about where " \
               "the grads live (grads= and grad_dtype=: rank 0: grads='device' as fp32 sums, " \
               "rank 1: grads='host')" in text, text[-2000:]


def test_two_replicas_of_two_shards_train_like_one_rank_and_resume_exactly(tmp_path):
    # Four processes standing in for two hosts of two GPUs: grads reduce-scattered within a
    # host, averaged across hosts; each rank holds half of the training state. A checkpoint
    # after step 2, loaded into freshly initialized ranks, continues bit for bit.
    got = run_ranks(tmp_path, "hsdp.pt", 4, shard_size=2, resume_at=2)
    assert_close(got, one_rank(tmp_path), atol=1e-5)
    assert got["resumed"] == got["losses"][2:]
    for name, value in got["state"].items():
        assert torch.equal(got["resumed_state"][name], value), name


def assert_state_halved(pieces, hsdp, params, hosts=2):
    """Each rank's optimizer state bytes are 1/hosts of the same rank's under HSDP, but for the
    pieces' padding: a chunk is padded to a multiple of 64 x hosts elements instead of 64 (at
    most 16 bytes of state an element)."""
    for got, whole in zip(pieces, hsdp):
        assert whole <= hosts * got <= whole + 16 * 64 * hosts * params, (pieces, hsdp)


def test_state_across_two_hosts_of_two_trains_like_one_rank_and_resumes_exactly(tmp_path):
    # Four processes standing in for two hosts of two GPUs, the optimizer state sharded across
    # the hosts too: each rank updates half of its chunk of every parameter (grads
    # reduce-scattered across the hosts, the updated halves all-gathered back at the next
    # forward pass, the host replica of the weights serving the backward pass). One rank
    # with all the rows is the oracle; a checkpoint after step 2 (every rank writes its own
    # piece) continues bit for bit in freshly initialized ranks.
    got = run_ranks(tmp_path, "pieces.pt", 4, shard_size=2, state_across_hosts=True,
                    resume_at=2)
    one = one_rank(tmp_path)
    assert_close(got, one, atol=1e-5)
    assert got["resumed"] == got["losses"][2:]
    for name, value in got["state"].items():
        assert torch.equal(got["resumed_state"][name], value), name
    hsdp = run_ranks(tmp_path, "hsdp.pt", 4, shard_size=2)
    assert_state_halved(got["state_bytes"], hsdp["state_bytes"], len(one["state"]))
    # The host replica: each rank keeps its chunks' weights whole (4 bytes an fp32 element, as
    # many elements as HSDP's rank keeps state for, but for the padding).
    for replica in got["replica_bytes"]:
        assert 4 * hsdp["elements"] <= replica <= 4 * (hsdp["elements"] + 128 * len(one["state"]))
    assert hsdp["replica_bytes"] == [0] * 4


def test_state_across_two_hosts_of_one_with_grad_changes_trains_like_one_rank(tmp_path):
    # Two processes standing in for two hosts of one GPU (shard_size=1: each host holds every
    # weight, each updates half of every parameter), with elementwise grad changes between
    # backward and step (each rank changes its own piece) and the clip (global norm summed
    # over the pieces), and resumed from a checkpoint after step 2.
    got = run_ranks(tmp_path, "pieces.pt", 2, shard_size=1, state_across_hosts=True,
                    grad_ops=True, resume_at=2)
    one = run_ranks(tmp_path, "one.pt", 1, grad_ops=True)
    assert_close(got, one, atol=1e-5)
    assert got["resumed"] == got["losses"][2:]
    for name, value in got["state"].items():
        assert torch.equal(got["resumed_state"][name], value), name
    # Each host keeps state for half of every streamed parameter (HSDP: all of it), its piece
    # padded so that the chunk is a multiple of 2 x 64 elements.
    params = len(one["state"])
    assert one["elements"] <= 2 * got["elements"] <= one["elements"] + 128 * params


def test_state_across_hosts_in_bf16_trains_like_one_rank(tmp_path):
    # bf16 weights, grads averaged in fp32 (reduce-scattered over the shards, then across the
    # hosts, rounded once into the piece's bf16 grad), st.gathered reading every piece back:
    # bf16's tolerance, as test_bf16_with_fp32_reduction_trains_like_one_rank.
    got = run_ranks(tmp_path, "bf16.pt", 4, shard_size=2, state_across_hosts=True,
                    dtype="bfloat16", reduce_dtype="float32", gathered=True)
    expected = run_ranks(tmp_path, "bf16-one.pt", 1, dtype="bfloat16", gathered=True)
    assert got["gathered_is_state"] is True and got["refused"] == [True] * 4
    assert_bf16_close(got, expected)


@pytest.mark.parametrize("case", ["one_replica", "nvme", "disagree", "resume_as_hsdp"])
def test_state_across_hosts_refuses_what_it_cannot_do_on_every_rank(tmp_path, case):
    # One replica (nothing to shard across), nvme= beside it, ranks that disagree about it:
    # offload raises on every rank before anything trains; a checkpoint of pieces loaded
    # under HSDP is refused by load_checkpoint (the state of half a chunk cannot fill it).
    (tmp_path / "tier").mkdir()
    options = {"--out": str(tmp_path / case), "--rows": ROWS, "--steps": 2, "--timeout": 20,
               "--state-across-hosts": True}
    expected = {
        "one_replica": "ValueError: strata.torch.offload: DataParallel(state_across_hosts=True) "
                       "shards the optimizer state across replicas",
        "nvme": "NotImplementedError: strata.torch.offload: nvme= with "
                "DataParallel(state_across_hosts=True)",
        "disagree": "rank 0: state_across_hosts=True; rank 1: state_across_hosts=False",
        "resume_as_hsdp": "the optimizer state across 2 hosts; this model trains by 2 "
                          "data-parallel ranks in shards of 1 (load it under the same layout)",
    }[case]
    options["--shard-size"] = 2 if case == "one_replica" else 1
    if case == "nvme":
        options["--nvme"] = tmp_path / "tier" / "t"
    if case == "disagree":
        options["--state-across-hosts-fault"] = "disagree"
    if case == "resume_as_hsdp":
        options.update({"--resume-at": 1, "--state-across-hosts-fault": "resume_as_hsdp"})
    codes, texts, _ = launch(2, options, limit=90, grace=5)
    for code, text in zip(codes, texts):
        assert code not in (0, None), text[-2000:]
        assert expected in text, text[-2000:]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adagrad", "lion"])
def test_each_optimizer_on_two_ranks_trains_like_ddp_and_resumes_exactly(optimizer, tmp_path):
    # st.SGD, st.Adam, st.Adagrad and st.Lion share st.AdamW's data-parallel path (its base
    # class): each rank updates its half of every streamed parameter with Strata's kernel of
    # the kind, the residents with the torch optimizer. Against DDP with torch's optimizer (Lion:
    # the same formula in torch), and a checkpoint after step 2 continues bit for bit. Lion
    # turns the last-bit differences of DDP's grads (see above) into steps of lr where the
    # moment is near zero: losses only.
    got = run_ranks(tmp_path, "strata.pt", 2, optimizer=optimizer, resume_at=2)
    ddp = run_ranks(tmp_path, "ddp.pt", 2, mode="ddp", optimizer=optimizer)
    if optimizer == "lion":
        for g, e in zip(got["losses"], ddp["losses"]):
            assert abs(g - e) <= 1e-5 * abs(e), (got["losses"], ddp["losses"])
    else:
        assert_close(got, ddp, atol=2e-6, rtol=1e-6)
    assert got["resumed"] == got["losses"][2:]
    for name, value in got["state"].items():
        assert torch.equal(got["resumed_state"][name], value), name


def test_gathered_is_collective_and_writes_every_shard(tmp_path):
    # st.gathered under sharding: every rank reads each parameter whole (all-gathered from
    # the shards), equal to model.state_dict()'s; a write on one rank inside
    # gathered(writable=False) is refused on every rank (no rank left waiting in a
    # collective); block 0 halved inside gathered(writable=True) on every rank reaches every
    # shard: the final state equals one rank doing the same.
    got = run_ranks(tmp_path, "gathered.pt", 2, gathered=True)
    expected = run_ranks(tmp_path, "gathered-one.pt", 1, gathered=True)
    assert got["gathered_is_state"] is True and expected["gathered_is_state"] is True
    assert got["refused"] == [True, True] and expected["refused"] == [True]
    assert_close(got, expected, atol=1e-5)
    untouched = run_ranks(tmp_path, "plain-one.pt", 1)
    name = next(k for k in expected["state"] if k.startswith("model.layers.0."))
    assert torch.equal(expected["state"][name], untouched["state"][name] * 0.5)


@pytest.mark.parametrize("how", ["raise", "kill", "stall"])
def test_a_failing_rank_takes_the_job_down(tmp_path, how):
    out = str(tmp_path / how)
    codes, texts, elapsed = launch(2, {"--out": out, "--rows": ROWS, "--steps": 3,
                                       "--fail": how, "--timeout": 5}, limit=90, grace=2)
    # Rank 0 stopped with Strata's error, naming itself and the collective, within the timeout
    # (plus start-up), instead of waiting for the failed rank forever.
    assert codes[0] not in (0, None), texts[0][-2000:]
    assert "strata.torch data parallel (rank 0 of 2)" in texts[0], texts[0][-3000:]
    assert "failed" in texts[0] and "DataParallelError" in texts[0], texts[0][-3000:]
    assert elapsed < 60, elapsed
    if how == "raise":
        assert "injected failure" in texts[1] and codes[1] not in (0, None), texts[1][-2000:]
    elif how == "kill":
        assert codes[1] == -9, codes


@pytest.mark.parametrize("budget", ["least", "planned", "share"])
def test_two_ranks_with_nvme_train_like_one_rank_and_resume_exactly(tmp_path, budget):
    # nvme= under data parallelism: each rank's runtime has its own tier file (<path>.rank<r>)
    # and a host_budget for its half of every parameter that is too small for its state:
    # "least" puts every block's weights and optimizer state on NVMe (the weights streamed
    # from the disk into the gathers, written back by the updates), "planned" the state of
    # the last blocks; "share" is the default host_budget on a host whose available memory
    # (as each rank reads it: more on rank 1) divided by its 2 ranks is about "planned"'s:
    # both ranks take rank 0's share. Both ranks adopt one placement; the training is one
    # process's with both ranks' rows (NVMe changes no value), and a checkpoint after step 2,
    # loaded into freshly initialized ranks whose tiers are other files, continues bit for bit.
    (tmp_path / "tier").mkdir()
    got = run_ranks(tmp_path, "nvme.pt", 2, nvme=tmp_path / "tier" / "t", host_budget=budget,
                    resume_at=2)
    ranks = got["nvme"]
    # One placement: each rank measured its rates and chose; both adopted the choice whose
    # predicted step is the slowest (its rates and all).
    slowest = max((r["own_choice"] for r in ranks), key=lambda i: i["predicted_step_seconds"])
    assert ranks[0]["choice"] == ranks[1]["choice"] == slowest, ranks
    assert ranks[0]["homes"] == ranks[1]["homes"], ranks
    for rank in ranks:
        assert rank["files"] == ["t.rank0", "t.rank1"], rank["files"]
        stats = rank["stats"]
        assert stats["nvme_state_params"] > 0 and stats["nvme_read_bytes"] > 0, rank["placement"]
        assert "on NVMe" in rank["placement"] and "staged through" in rank["placement"]
        if budget == "least":
            assert rank["weights_on_nvme"] == stats["params"], rank["placement"]
            assert "the weights of 4 blocks on NVMe" in rank["placement"], rank["placement"]
        else:
            assert rank["weights_on_nvme"] == 0, rank["placement"]
            assert stats["nvme_state_params"] < stats["params"], rank["placement"]
        if budget == "share":  # (the runtime rounds its budget up to 4 KiB pages)
            expected = ranks[0]["expected_host_budget"]
            assert 0 <= rank["host_budget"] - expected < 4096, (rank["host_budget"], expected)
    assert_close(got, one_rank(tmp_path), atol=1e-5)
    assert got["resumed"] == got["losses"][2:]
    for name, value in got["state"].items():
        assert torch.equal(got["resumed_state"][name], value), name


@pytest.mark.parametrize("fault", ["unwritable", "disagree"])
def test_nvme_a_rank_cannot_use_is_refused_on_every_rank(tmp_path, fault):
    # The last rank's tier would be in a folder that does not exist, or the last rank passes
    # no nvme=: offload refuses on every rank, naming the rank and the problem, before
    # anything is created (no rank left waiting in a collective).
    (tmp_path / "tier").mkdir()
    out = str(tmp_path / fault)
    codes, texts, elapsed = launch(2, {"--out": out, "--rows": ROWS, "--steps": 1,
                                       "--nvme": tmp_path / "tier" / "t", "--nvme-fault": fault,
                                       "--timeout": 20}, limit=60, grace=5)
    expected = ("rank 1: %s: No such file or directory" % (tmp_path / "tier" / "missing" /
                                                           "tier.rank1")
                if fault == "unwritable" else "rank 1: no nvme=")
    for code, text in zip(codes, texts):
        assert code not in (0, None), text[-2000:]
        assert "ValueError: strata.torch.offload" in text and expected in text, text[-2000:]
    assert elapsed < 20, elapsed
    assert os.listdir(tmp_path / "tier") == []  # the probe left nothing behind


# --- the GPU path's stream ordering, modelled on the CPU -----------------------------------------
#
# gloo is synchronous: every collective is done when it returns, so the gloo runs above cannot
# see a missing ordering between the CUDA streams the layout uses on a GPU (compute, the
# communication stream, the reduction stream, NCCL's own). The test below runs the layout's
# real step (its acquire, store_grads and release, two steps of three blocks) over streams that
# keep vector clocks instead of running anything: torch's CUDA stream and event calls are
# replaced by ones that record what each stream has waited for, torch's collectives by NCCL's
# ordering (its stream waits for the issuing stream; wait() makes the current stream wait for
# it), the executor by its documented one (acquire makes the stream wait for the load, the
# release point orders the slot's refill and the grads' D2H), and every tensor operation is
# seen through a TorchFunctionMode as reads and writes of memory on the current stream. Two
# accesses of the same bytes, one a write, on different streams must be ordered by the clocks.


class _Stream:
    def __init__(self, timeline, name):
        self.timeline, self.name, self.clock = timeline, name, {}
        self.cuda_stream = self  # the handle the layout passes to the executor

    def wait_event(self, event):
        _merge(self.clock, event.clock)

    def wait_stream(self, other):
        _merge(self.clock, other.clock)


def _merge(into, clock):
    for s, t in clock.items():
        into[s] = max(into.get(s, 0), t)


class _Timeline:
    def __init__(self):
        self.compute = _Stream(self, "compute")
        self.current = self.compute
        self.host = {}  # what the host has waited for: later work on any stream follows it
        self.accesses = []  # (start, end, write, stream, tick, what)
        self.alive = []  # every tensor accessed: its memory is never reused during the test
        self.hazards = []
        self.phase = ""  # what the step is doing, for the hazards' text

    def stream(self, name):
        return _Stream(self, name)

    def host_waits(self, stream):
        _merge(self.host, stream.clock)

    def access(self, what, reads=(), writes=()):
        what = "%s (%s)" % (self.phase, what)
        s = self.current
        _merge(s.clock, self.host)
        s.clock[s] = s.clock.get(s, 0) + 1
        tick = s.clock[s]
        for t, write in [(t, False) for t in reads] + [(t, True) for t in writes]:
            if t.numel() == 0:
                continue
            self.alive.append(t)
            start = t.data_ptr()
            end = start + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * \
                t.element_size()
            for a_start, a_end, a_write, a_stream, a_tick, a_what in self.accesses:
                if (write or a_write) and a_start < end and start < a_end and \
                        a_stream is not s and s.clock.get(a_stream, 0) < a_tick:
                    self.hazards.append("%s on %s, unordered with %s on %s" % (
                        what, s.name, a_what, a_stream.name))
            self.accesses.append((start, end, write, s, tick, what))


class _Event:
    def __init__(self, timeline):
        self.timeline, self.clock = timeline, {}

    def record(self, stream=None):
        self.clock = dict((stream or self.timeline.current).clock)

    def query(self):
        return True


class _Accesses(torch.overrides.TorchFunctionMode):
    """Every torch operation as reads and writes on the timeline's current stream: an in-place
    one (copy_, zero_) writes its first tensor and reads the rest; one that makes new tensors
    reads its inputs and writes them; views (slicing, reshape, a no-op to()) and allocations
    (torch.empty) touch nothing."""

    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)]
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__") and inputs:
            self.timeline.access(name, reads=inputs[1:], writes=inputs[:1])
            return out
        if name in ("empty", "empty_like", "empty_strided"):
            return out  # an allocation writes nothing
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        fresh = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                 and t.untyped_storage().data_ptr() not in storages]
        if fresh:
            self.timeline.access(name, reads=inputs, writes=fresh)
        return out


class _Work:
    def __init__(self, timeline, stream):
        self.timeline, self.stream = timeline, stream

    def wait(self, timeout=None):
        self.timeline.current.wait_stream(self.stream)


def _nccl(timeline):
    """torch.distributed's collectives as NCCL orders them: each runs on a stream of its own
    that waits for the issuing stream at the call, reading all of its input and writing all of
    its output there (no values are computed: only the ordering is checked)."""
    def run(what, reads, writes):
        stream = timeline.stream("nccl")
        stream.wait_stream(timeline.current)
        issuing, timeline.current = timeline.current, stream
        try:
            timeline.access(what, reads, writes)
        finally:
            timeline.current = issuing
        return _Work(timeline, stream)

    def all_gather_into_tensor(out, chunk, group=None, async_op=False):
        return run("NCCL all-gather", [chunk], [out])

    def reduce_scatter_tensor(out, full, op=None, group=None, async_op=False):
        return run("NCCL reduce-scatter", [full], [out])

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return run("NCCL all-reduce", [tensor], [tensor])

    return types.SimpleNamespace(all_gather_into_tensor=all_gather_into_tensor,
                                 reduce_scatter_tensor=reduce_scatter_tensor,
                                 all_reduce=all_reduce,
                                 ReduceOp=types.SimpleNamespace(AVG="avg", SUM="sum"))


class _Executor:
    """Strata's executor as the layout sees it: one slot per block (weights, and grads in the
    backward pass); acquire loads it on the given stream after the slot's last release point
    (the grads zeroed there; grads summed in place on the device: where the param held none);
    a backward release's grads leave for DRAM (or, summed in place, are read by the
    optimizer's landing) from its stream's point."""

    def __init__(self, timeline, layers):
        self.timeline = timeline
        self.weights = [[torch.zeros(sp.piece) for sp in entries] for entries in layers]
        self.grads = [[torch.zeros(sp.piece) for sp in entries] for entries in layers]
        self.released = [{} for _ in layers]

    def _on(self, stream, what, reads=(), writes=()):
        issuing, self.timeline.current = self.timeline.current, stream
        try:
            self.timeline.access(what, reads, writes)
        finally:
            self.timeline.current = issuing

    def acquire(self, index, phase, stream):
        _merge(stream.clock, self.released[index])
        grads = self.grads[index] if phase == BACKWARD else []
        self._on(stream, "the executor's load", writes=self.weights[index] + grads)

    def view(self, index, phase, role, i):
        return (self.weights if role == VIEW_WEIGHT else self.grads)[index][i]

    def release(self, index, phase, stream):
        self.released[index] = dict(stream.clock)
        if phase == BACKWARD:
            self._on(stream, "the executor's D2H of the grads", reads=self.grads[index])


def _model_step(monkeypatch, shard_size, pieces, in_place=False, steps=2, blocks=3):
    """The hazards of `steps` training steps of the layout over the modelled streams."""
    from strata.torch import _distributed
    from strata.torch.layout.sharded import ShardedLayout
    timeline = _Timeline()
    monkeypatch.setattr(_distributed, "dist", _nccl(timeline))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: timeline.current)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(timeline))

    @contextlib.contextmanager
    def on(stream):
        issuing, timeline.current = timeline.current, stream
        try:
            yield
        finally:
            timeline.current = issuing
    monkeypatch.setattr(torch.cuda, "stream", on)

    mesh = _distributed.Mesh.__new__(_distributed.Mesh)
    replicas = 2
    group = object()
    mesh.__dict__.update(
        failed=None, backend="nccl", timeout=None, reduce_dtype=None, shard_size=shard_size,
        replicas=replicas, world=shard_size * replicas, rank=0, shard_rank=0, replica=0,
        pieces=pieces, all=group, replica_group=group, piece_group=group if pieces > 1 else None,
        gather_group=group if shard_size > 1 else None,
        reduce_group=group if shard_size > 1 else None)
    layout = ShardedLayout(mesh, residents=[])
    session = types.SimpleNamespace(cuda=False, device=torch.device("cpu"), dtype=torch.float32,
                                    step_id=0, delivered=[], host_budget=None, optimizer=None,
                                    layers=[], unbind=lambda index: None,
                                    grads_in_place=in_place)
    for i in range(blocks):
        entries = []
        for j, shape in enumerate([(8, 12), (40,)]):
            sp = layout.streamed_param(torch.nn.Parameter(torch.zeros(shape)), "b%d.p%d" % (i, j),
                                       "p%d" % j, i, j)
            sp.grad, sp.grad_index = object(), j  # trainable
            entries.append(sp)
        session.layers.append(entries)
    layout.session = session
    layout.after_build()  # (cuda=False here: the host replica is not pinned)
    session.cuda = True
    session.executor = _Executor(timeline, session.layers)
    layout.gathers.comm = timeline.stream("comm")
    layout.reducer.reduce_stream = timeline.stream("reduce")

    def compute(index, pass_name):
        timeline.phase = "block %d %s" % (index, pass_name)
        with torch.no_grad():
            return [sp.param * 2 for sp in session.layers[index]]

    with _Accesses(timeline):
        for step in range(steps):
            session.step_id += 1
            for i in range(blocks):
                timeline.phase = "block %d forward" % i
                layout.acquire(i, FORWARD)
                compute(i, "forward")
                layout.release(i, FORWARD)
            for i in reversed(range(blocks)):
                timeline.phase = "block %d backward" % i
                layout.acquire(i, BACKWARD)
                grads = compute(i, "backward")
                timeline.phase = "block %d backward" % i
                layout.store_grads(i, session.layers[i], grads)
                layout.release(i, BACKWARD)
            timeline.host_waits(layout.reducer.reduce_stream)  # step_end: the grads landed
            layout.after_end(0, BACKWARD)
            session.delivered.clear()
    return timeline.hazards


@pytest.mark.parametrize("in_place", [False, True], ids=["grads", "sums_in_place"])
@pytest.mark.parametrize("shard_size,pieces", [(1, 2), (1, 1), (2, 2), (2, 1)],
                         ids=["pieces_hosts_of_one", "hsdp_hosts_of_one", "pieces_hosts_of_two",
                              "hsdp_hosts_of_two"])
def test_every_stream_access_of_the_gpu_path_is_ordered(monkeypatch, shard_size, pieces,
                                                        in_place):
    # Found on 2 H200s: hosts of one GPU (no shard group, so no NCCL reduce-scatter issued on
    # the compute stream) left the reduction stream unordered with the compute stream, and the
    # replicas' collectives read the grads before they were written (state across hosts
    # trained wrongly; HSDP all-reduced the grads' zeroed views). in_place: the grad views are
    # the fp32 sums on the device (offload(grads="device")), the reduced grads added into them
    # on the reduction stream (after the load's zeroing, before the landing's read).
    hazards = _model_step(monkeypatch, shard_size, pieces, in_place)
    assert not hazards, "\n".join(hazards[:10])
