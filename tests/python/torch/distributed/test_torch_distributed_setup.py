"""strata.torch data parallel's set-up (issue 39) on the CPU: ranks are processes under a gloo
process group running tests/python/support/torch_dist_setup_worker.py.

- A rank whose set-up fails alone (an argument of offload, its host_budget, its runtime, the
  disk's measurement, the move of the model to its device) stops every rank at once: the
  failed rank raises its own error, the others a DataParallelError naming it and its error,
  within seconds, not DataParallel's timeout; every rank undoes its offload, and the job can
  offload again. Ranks that disagree about DataParallel's options all raise the same
  ValueError. So does a rank whose optimizer's build fails alone (st.AdamW): every rank
  raises at once and closes its session.
- With nvme=, one rank of the ranks of a host that share its disks measures them, and each
  rank's placement counts its share of the measured rates; every rank adopts one placement.
- Without nvme=, the default DRAM budget's room for gradient accumulators is judged against the
  rank's share of the host's available memory, and so is the default host budget's room for
  strata.torch's own pools (half of the share: the library's step plan); a given host_budget is each rank's.
- Under DataParallel(state_across_hosts=True) the arena is sized for the rank's pieces, with
  the host replica of the weights beside it in the host budget, not as for HSDP."""
import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)
import rank_launch  # noqa: E402
import torch_dist_setup_worker as worker  # noqa: E402

# DataParallel's timeout in the worker, deliberately long: a rank left waiting in a collective
# would take this long, far past launch's limit (a hang fails the test instead).
TIMEOUT = 300


def launch(tmp_path, world, limit=90, **args):
    """Run `world` ranks to their end (each killed past `limit` s: a hang fails the test);
    returns every rank's output (the worker's JSON)."""
    out = str(tmp_path / "out")
    argv = ["--world", str(world), "--port", str(rank_launch.free_port()), "--out", out,
            "--timeout", str(TIMEOUT)]
    for k, v in args.items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    # A forkserver that imported torch and strata.torch once (as test_torch_distributed.py).
    ctx = rank_launch.forkserver("torch", "torch.distributed", "torch._dynamo", "strata.torch",
                                 "torch_dist_worker", "torch_dist_setup_worker")
    # The logs beside the outputs: "log.rankR" (the worker writes its JSON to "out.rankR").
    codes, texts, late = rank_launch.launch(ctx, worker.entry, argv, world,
                                            str(tmp_path / "log"), limit)
    assert not late and codes == [0] * world, (
        "ranks hung (past %d s: %s), exit codes %s:\n%s" % (
            limit, late, codes, "\n".join(t[-3000:] for t in texts)))
    results = []
    for rank in range(world):
        with open("%s.rank%d" % (out, rank)) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("fault", ["argument", "budget", "runtime", "measure", "residents"])
def test_a_rank_whose_setup_fails_stops_every_rank_at_once(tmp_path, fault):
    # "argument": rank 1 passes grads='gpu' (refused before the ranks' first collective, the
    # Mesh's); "budget": rank 1's host_budget (1 MiB) cannot hold its chunks of the blocks;
    # "runtime": rank 1's runtime is asked for a DRAM budget beyond the host's memory (the
    # library refuses it); "measure" (with nvme=): the disk's measurement fails on rank 0,
    # the rank measuring it for both; "residents": rank 1 cannot move the embedding to its
    # device. Before, the other rank went on to its next collective and waited there for
    # the timeout (600 s by default; TIMEOUT here).
    options = {"fault": fault}
    failing = 1
    if fault == "measure":
        (tmp_path / "tier").mkdir()
        options.update(nvme=tmp_path / "tier" / "t", fault_rank=0)
        failing = 0
    ranks = launch(tmp_path, 2, **options)
    cause = {"argument": "ValueError: strata.torch.offload: grads is 'gpu', not 'host' or "
                         "'device'",
             "budget": "ValueError: strata.torch.offload: host_budget %d bytes is below the "
                       % (1 << 20),
             "runtime": "OutOfMemory: OUT_OF_MEMORY: strata_runtime_create: hbm_budget_bytes",
             "measure": "OSError: injected: the disk cannot be measured",
             "residents": "RuntimeError: injected: no device memory for Embedding"}[fault]
    what = {"argument": "checking strata.torch.offload's arguments",
            "budget": "checking host_budget",
            "runtime": "creating the session's Strata runtime",
            "measure": "measuring the NVMe tier's rates",
            "residents": "installing the streamed blocks and moving the rest of the model"}[fault]
    for r in ranks:
        assert r["seconds"] < 30 < TIMEOUT, r  # at once, not at the timeout
        assert r["offloaded"] is False, r  # undone: the model as it was
        message = r["message"]
        assert what in message and "failed on rank %d (%s" % (failing, cause) in message, r
        if r["rank"] == failing:  # its own error, the note naming it
            assert r["error"] != "DataParallelError", r
            assert "strata.torch data parallel (rank %d of 2)" % failing in message, r
        else:
            assert r["error"] == "DataParallelError", r
            assert "strata.torch data parallel (rank %d of 2)" % r["rank"] in message, r
        if fault == "runtime":
            assert "dram_budget_bytes %d exceed" % (1 << 60) in message, r
    # The job went on: the ranks offloaded again and trained a step together.
    assert ranks[0]["losses"] == ranks[1]["losses"], ranks


def test_ranks_that_disagree_about_data_parallel_options_all_raise_alike(tmp_path):
    # Rank 1 passes DataParallel(shard_size=1), rank 0 the default (the ranks of its host, 2):
    # the ranks would make different process groups. Before, rank 1 made its groups and rank 0
    # others, and both waited in them for the timeout.
    ranks = launch(tmp_path, 2, fault="options")
    for r in ranks:
        assert r["seconds"] < 30 < TIMEOUT, r
        assert r["error"] == "ValueError" and r["offloaded"] is False, r
        assert "the data-parallel ranks disagree about DataParallel's options" in \
            r["message"], r
        assert "rank 0: shard_size=None" in r["message"], r
        assert "rank 1: shard_size=1" in r["message"], r
    assert ranks[0]["losses"] == ranks[1]["losses"], ranks


@pytest.mark.parametrize("fault", ["optimizer", "write"])
def test_a_rank_whose_optimizer_build_fails_stops_every_rank_at_once(tmp_path, fault):
    # st.AdamW builds the session: gathers (the placement, the CPU threads), a broadcast of
    # every parameter from rank 0 and this rank's own work between them. "optimizer": rank 1
    # cannot create the runtime's optimizer; "write": rank 1 cannot write block 1's values
    # into its runtime (rank 0 goes on broadcasting block 2's). Before, rank 0 waited in its
    # next broadcast (or its first training step's gather) for the timeout.
    ranks = launch(tmp_path, 2, fault=fault)
    cause = {"optimizer": "MemoryError: injected: no host memory for the optimizer",
             "write": "OSError: injected: writing model.layers.1."}[fault]
    what = {"optimizer": "creating the optimizer and registering the streamed blocks",
            "write": "writing streamed block 1's values"}[fault]
    for r in ranks:
        assert r["where"] == "optimizer" and r["seconds"] < 30 < TIMEOUT, r
        message = r["message"]
        assert what in message and "failed on rank 1 (%s" % cause in message, r
        if r["rank"] == 1:  # its own error, the note naming it
            assert r["error"] == cause.split(":")[0], r
            assert "strata.torch data parallel (rank 1 of 2)" in message, r
        else:
            assert r["error"] == "DataParallelError", r
            assert "strata.torch data parallel (rank 0 of 2)" in message, r
        # Half built on every rank: each closed its session (the runtime's memory released).
        assert r["closed"] is True, r


@pytest.mark.parametrize("world,hosts", [(2, 1), (4, 2)])
def test_one_rank_of_a_host_measures_its_disk_for_the_others(tmp_path, world, hosts):
    # The ranks of a host with their tier files on one file system: the first of them
    # measures the disk, once, and every one of them counts its share of the rates (the
    # measured ones over the ranks sharing the disk) when it chooses; all adopt one
    # placement. (4, 2): four ranks standing in for two hosts of two (by the host names they
    # report): one measuring rank per host.
    (tmp_path / "tier").mkdir()
    ranks = launch(tmp_path, world, limit=150, nvme=tmp_path / "tier" / "t", hosts=hosts)
    per_host = world // hosts
    leaders = [r for r in range(world) if r % per_host == 0]
    assert [r["rank"] for r in ranks if r["disk_calls"]] == leaders, ranks
    for r in ranks:
        assert "error" not in r, r
        if r["rank"] in leaders:
            assert len(r["disk_calls"]) == 1, r  # measured once
        measured = ranks[r["rank"] // per_host * per_host]["disk_calls"][0]
        own = r["own_choice"]
        assert own["nvme_read_bytes_per_second"] == pytest.approx(
            measured["nvme_read_bytes_per_second"] / per_host), (r, measured)
        assert own["nvme_write_bytes_per_second"] == pytest.approx(
            measured["nvme_write_bytes_per_second"] / per_host), (r, measured)
        assert own["nvme_mixed"] == measured["nvme_mixed"], (r, measured)
        assert r["homes"] == ranks[0]["homes"], r
        assert r["losses"] == ranks[0]["losses"], ranks


def test_each_rank_judges_the_accumulators_room_against_its_share_of_the_host(tmp_path):
    # The host's available memory (patched) holds one rank's arena and gradient accumulators
    # with room to spare (1.5 times them within the 85% share), not two ranks' (each judged
    # against all of it, two ranks would pin 170% of it): one rank alone gets the room, each of
    # two ranks its arena without it (the accumulators go where the optimizer finds room).
    alone = launch(tmp_path, 1, accumulator_room=True)[0]["arena"]
    assert alone["budget"] >= alone["need"] + alone["accumulators"], alone
    for r in launch(tmp_path, 2, accumulator_room=True):
        arena = r["arena"]
        assert arena["need"] <= arena["budget"] < arena["need"] + arena["accumulators"], r


def _arena(counts):
    """(what the blocks of `counts` elements need in DRAM, what the runtime's arena can use
    for them: the gradient accumulators too), fp32 (the tiny model's):
    strata.torch._planning.arena_need."""
    from strata.torch import _planning
    dram, accum = _planning.arena_need(counts, torch.float32, "dram")
    return dram, dram + accum


def _pinned(budget):
    """The arena a DRAM budget pins: rounded up to 4 KiB (the runtime's, NvmeTier::kAlignment);
    the host budget's account counts what is pinned."""
    return -(-budget // 4096) * 4096


def test_a_default_host_budget_is_each_rank_share_of_the_host(tmp_path):
    # The host's available memory (patched) is divided among the ranks of the host: the pools
    # (paged optimizer state, spilled checkpoints) of each of 2 ranks get half of what 1 rank
    # alone gets, and each arena is what its chunks need. Before, each of k ranks took
    # Half of the whole host (2 ranks: all of it).
    from strata.torch import _planning
    from strata.torch._distributed import chunk_elements
    available = 64 << 30
    alone = launch(tmp_path, 1, available=available)[0]
    ranks = launch(tmp_path, 2, available=available)
    pools = {}
    for r in [alone] + ranks:
        world = 1 if r is alone else 2
        budget = r["budget"]
        _, arena = _arena([sum(chunk_elements(n, world) for n in block)
                           for block in r["numels"]])
        assert budget["given"] is None, r
        assert budget["arena"] == budget["runtime_dram"] == _pinned(arena), r
        pools.setdefault(world, []).append(budget["total"] - budget["arena"])
    assert pools[1] == [int(0.5 * available)], pools
    assert pools[2] == [int(0.5 * (available // 2))] * 2, pools
    assert abs(2 * pools[2][0] - pools[1][0]) <= 1, pools
    # A given host_budget is each rank's, as documented: each of 2 ranks gets all of it.
    given = 1 << 30
    for r in launch(tmp_path, 2, available=available, host_budget=given):
        budget = r["budget"]
        _, arena = _arena([sum(chunk_elements(n, 2) for n in block) for block in r["numels"]])
        assert arena < given, r
        assert (budget["given"], budget["total"], budget["arena"]) == \
            (given, given, _pinned(arena)), r


def test_state_across_hosts_sizes_the_arena_for_its_pieces_beside_the_host_replica(tmp_path):
    # 2 ranks standing in for 2 hosts of one rank each (shard_size 1, 2 replicas): with the
    # state across the hosts each runtime holds half of every chunk (its piece) and the layout
    # pins the whole chunk's weights as its host replica beside the arena. Before, a given
    # host_budget sized the arena as for HSDP (whole chunks): pinned memory nobody used, and a
    # budget that holds the pieces and the replica was refused.
    from strata.torch import _planning
    from strata.torch._distributed import chunk_elements
    available = 64 << 30
    big = 4 << 30
    across = launch(tmp_path, 2, hosts=2, state_across_hosts=True, host_budget=big,
                    available=available)
    numels = across[0]["numels"]
    chunks = [[chunk_elements(n, 1, 2) for n in block] for block in numels]
    pieces_need, pieces = _arena([sum(c // 2 for c in block) for block in chunks])
    hsdp_need, hsdp = _arena([sum(chunk_elements(n, 1) for n in block) for block in numels])
    replica = 4 * sum(map(sum, chunks))  # fp32 weights
    assert pieces < hsdp and pieces + replica < big, (pieces, hsdp, replica)
    held = "host replica of the weights"
    for r in across:  # the arena what the pieces can use, the replica beside it
        budget = r["budget"]
        assert (budget["total"], budget["arena"], budget["runtime_dram"]) == \
            (big, _pinned(pieces), _pinned(pieces)), r
        assert budget["held"][held] == replica, r
    for r in launch(tmp_path, 2, hosts=2, host_budget=big, available=available):
        assert (r["budget"]["arena"], r["budget"]["runtime_dram"]) == (_pinned(hsdp),) * 2, r
    assert across[0]["losses"] == across[1]["losses"], across
    # A budget that holds the pieces' blocks and the replica, not HSDP's chunks: the pieces
    # train in it, the arena the budget less the replica; HSDP is refused on both ranks.
    tight = pieces_need + replica
    assert tight < hsdp_need
    for r in launch(tmp_path, 2, hosts=2, state_across_hosts=True, host_budget=tight,
                    available=available):
        budget = r["budget"]
        # The runtime counts the arena and the replica (a host buffer) in whole 4 KiB pages
        # (strata.h "Host buffers"): a budget that holds both but for those roundings is raised
        # by them (less than a page each), never refused.
        assert budget["arena"] == _pinned(pieces_need), r
        assert tight <= budget["total"] < tight + 2 * 4096, r
        assert replica <= budget["held"][held] < replica + 4096 and len(r["losses"]) > 0, r
    for r in launch(tmp_path, 2, hosts=2, host_budget=tight, available=available):
        assert r["error"] == "ValueError", r
        assert "host_budget %d bytes is below the %d bytes" % (tight, hsdp_need) in \
            r["message"], r
    # The default: the arena what the pieces can use; the host budget holds it, the replica
    # and half of what the replica leaves of the rank's share of the host.
    for r in launch(tmp_path, 2, hosts=2, state_across_hosts=True, available=available):
        budget = r["budget"]
        assert budget["given"] is None and budget["arena"] == _pinned(pieces), r
        assert budget["total"] == _pinned(pieces) + replica + int(
            0.5 * (available - replica)), r
        assert budget["held"][held] == replica, r
