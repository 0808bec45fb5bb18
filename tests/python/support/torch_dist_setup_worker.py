"""One rank of the data-parallel set-up tests
(tests/python/torch/distributed/test_torch_distributed_setup.py):
offloads the tiny Llama-style model on the CPU under a gloo process group, with a fault on one
rank (--fault) or not, and writes what it saw to <--out>.rank<r> (JSON): the error offload
raised and how long it took, who measured the disk and what rates each rank's placement
counted, where the state went, what its host budget account got (--available,
--host-budget, --state-across-hosts). The model and the training loop are the data-parallel
tests' (torch_dist_worker)."""
import argparse
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist

import torch_dist_worker as base


def inject(fault, disk_calls):
    """Arm this rank's fault (None: none, the functions as they were), and count core.place's
    disk measurements (`disk_calls`: per measuring call, the rates it measured). The faults:
    "runtime": the runtime is asked for a DRAM budget no host has (the library's own error);
    "measure": measuring the disk fails; "residents": moving the model outside the streamed
    blocks to the device fails; "optimizer": creating the runtime's optimizer fails (in
    st.AdamW, after the build's first collectives); "write": writing block 1's values into the
    runtime fails (st.AdamW, between the build's broadcasts). The faults of offload's
    arguments ("budget", "argument", "options") are in main."""
    import strata.core as core
    from strata.torch import _surgery
    from strata.torch.session.session import StrataSession
    if not _REAL:
        _REAL.update(runtime=core.Runtime, place=core.place, materialize=_surgery.materialize,
                     optimizer=core.Optimizer, write=StrataSession.write_values)
    real = _REAL
    core.Runtime, _surgery.materialize = real["runtime"], real["materialize"]
    core.Optimizer, StrataSession.write_values = real["optimizer"], real["write"]
    if fault == "runtime":
        def runtime(**options):
            return real["runtime"](**dict(options, dram_budget=1 << 60))
        core.Runtime = runtime
    if fault == "optimizer":
        def optimizer(*args, **kwargs):
            raise MemoryError("injected: no host memory for the optimizer")
        core.Optimizer = optimizer
    if fault == "write":
        def write_values(session, sp, *args, **kwargs):
            if sp.layer == 1:
                raise OSError("injected: writing %s failed" % sp.name)
            return real["write"](session, sp, *args, **kwargs)
        StrataSession.write_values = write_values

    def place(layers, runtime=None, rates=None, **options):
        measures = runtime is not None and runtime.capabilities().tiers_available[2] and \
            not (rates or {}).get("nvme_read")
        if measures and fault == "measure":
            raise OSError("injected: the disk cannot be measured")
        choice = real["place"](layers, runtime=runtime, rates=rates, **options)
        if measures:
            disk_calls.append({k: choice.info[k] for k in (
                "nvme_read_bytes_per_second", "nvme_write_bytes_per_second", "nvme_mixed")})
        return choice
    core.place = place
    if fault == "residents":
        def failing(module, *args, **kwargs):
            if any(True for _ in module.parameters(recurse=False)):
                raise RuntimeError("injected: no device memory for %s" % type(module).__name__)
            return real["materialize"](module, *args, **kwargs)
        _surgery.materialize = failing


_REAL = {}  # the functions inject replaces, as they were


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fault", default=None,
                   choices=["runtime", "measure", "residents", "optimizer", "write", "budget",
                            "argument", "options"],
                   help="inject's faults, and offload's arguments wrong on one rank: "
                        "'budget' a host_budget too small for the streamed blocks, 'argument' "
                        "grads='gpu', 'options' DataParallel(shard_size=1) where the others "
                        "shard over every rank")
    p.add_argument("--fault-rank", type=int, default=None, help="default: the last rank")
    p.add_argument("--nvme", default=None, help="every rank's NVMe tier (<path>.rank<r>)")
    p.add_argument("--hosts", type=int, default=1,
                   help="the ranks stand for this many hosts (consecutive ranks, as torchrun "
                        "assigns them), by the host name each one reports")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--accumulator-room", action="store_true",
                   help="the host's available memory (patched) holds one rank's arena and "
                        "gradient accumulators, not every rank's: 'arena' in the output says "
                        "what this rank's runtime got, beside what it needs with and without "
                        "the accumulators")
    p.add_argument("--available", type=int, default=None,
                   help="the host's available memory (patched), bytes; 'budget' in the output "
                        "says what this rank's host budget account got")
    p.add_argument("--host-budget", type=int, default=None, help="offload(host_budget=)")
    p.add_argument("--state-across-hosts", action="store_true",
                   help="DataParallel(state_across_hosts=True) (with --hosts: one per rank)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.hosts > 1:
        name = "host%d" % (args.rank // (args.world // args.hosts))
        socket.gethostname = lambda: name
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % args.port,
                            rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    import strata.torch as st
    fault_rank = args.world - 1 if args.fault_rank is None else args.fault_rank
    disk_calls = []
    inject(args.fault if args.rank == fault_rank else None, disk_calls)
    config, model = base.build("tiny", seed=args.rank)
    options = {"nvme": args.nvme} if args.nvme else {}
    if args.host_budget is not None:
        options["host_budget"] = args.host_budget
    if args.available is not None:
        from strata.torch import _host
        _host.mem_available = lambda: args.available
    if args.accumulator_room:
        from strata.torch import _host, _planning
        from strata.torch._distributed import chunk_elements
        counts = [sum(chunk_elements(p.numel(), args.world) for p in block.parameters())
                  for block in model.model.layers]
        dram, accum = _planning.arena_need(counts, torch.float32, "dram")
        available = int((dram + accum) / _planning.HOST_SHARE * 1.5)
        _host.mem_available = lambda: available
        out_arena = {"need": dram, "accumulators": accum}
    parallel = st.DataParallel(timeout=args.timeout,
                               state_across_hosts=args.state_across_hosts)
    # offload's arguments wrong on the failing rank alone (the others' as given).
    wrong = {}
    if args.rank == fault_rank:
        if args.fault == "budget":
            wrong = {"host_budget": 1 << 20}
        elif args.fault == "argument":
            wrong = {"grads": "gpu"}
        elif args.fault == "options":
            wrong = {"data_parallel": st.DataParallel(
                timeout=args.timeout, shard_size=1, state_across_hosts=args.state_across_hosts)}
    out = {"rank": args.rank,
           # per streamed block, its parameters' elements (every block streams on the CPU)
           "numels": [[p.numel() for p in block.parameters()] for block in model.model.layers]}
    started = time.monotonic()
    try:
        st.offload(model, **dict(dict(device="cpu", data_parallel=parallel, **options), **wrong))
    except Exception as e:  # the fault: every rank raises
        out.update(failed(e, started), where="offload",
                   offloaded=getattr(model, "strata", None) is not None)
        if args.fault is None:  # refused as the test expects: nothing to train
            with open("%s.rank%d" % (args.out, args.rank), "w") as f:
                json.dump(out, f)
            dist.barrier()
            dist.destroy_process_group()
            return
        # The job goes on: offload leaves the model as it was on every rank, and the ranks are
        # in step for their next collectives.
        inject(None, disk_calls)
        st.offload(model, device="cpu", data_parallel=parallel, **options)
    session = model.strata
    if args.fault in ("optimizer", "write"):  # the optimizer's build fails on one rank
        started = time.monotonic()
        try:
            st.AdamW(model.parameters(), lr=1e-3)
        except Exception as e:  # every rank raises, and closes its session
            out.update(failed(e, started), where="optimizer", closed=session.closed)
        with open("%s.rank%d" % (args.out, args.rank), "w") as f:
            json.dump(out, f)
        dist.barrier()  # the job's own group still works: the ranks are in step
        dist.destroy_process_group()
        return
    out["disk_calls"] = disk_calls
    if args.accumulator_room:
        out["arena"] = dict(out_arena,
                            budget=session.runtime.capabilities().tier_budget_bytes[1])
    if session.placement_choice is not None:
        out["own_choice"] = session.placement_choice.info  # before the ranks adopt one
    budget = session.host_budget
    out["budget"] = {"total": budget.total, "arena": budget.arena, "given": budget.given,
                     "runtime_dram": session.runtime.capabilities().tier_budget_bytes[1]}
    opt = st.AdamW(model.parameters(), lr=1e-3)
    data = base.batches(config, 1, 2 * args.world, 16)
    out["losses"] = base.loop(model, opt, data, args.rank, args.world, 0.0)
    out["budget"]["held"] = budget.held()  # the pools, the host replica among them
    if session.placement_choice is not None:
        out["homes"] = session.placement_choice.homes
        out["nvme_state_params"] = session.optimizer.stats()["nvme_state_params"]
    with open("%s.rank%d" % (args.out, args.rank), "w") as f:
        json.dump(out, f)
    dist.barrier()
    session.close()
    dist.destroy_process_group()


def failed(error, started):
    """What the test checks of the error a rank raised: its type, its message with its notes,
    and how long after `started` it came."""
    return {"seconds": time.monotonic() - started, "error": type(error).__name__,
            "message": "\n".join([str(error)] + list(getattr(error, "__notes__", [])))}


def entry(argv, log):
    """A rank started by the test's forkserver: its output goes to the file `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    main(argv)
