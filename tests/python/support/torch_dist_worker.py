"""One rank of the data-parallel tests (tests/python/torch/distributed/test_torch_distributed.py):
trains the tiny Llama-style model on the CPU through strata.torch under a gloo process group
(or through plain PyTorch DDP), on its slice of every step's batch, and rank 0 writes the
losses (averaged over the ranks) and the final parameters to --out. --fail makes the last rank
fail mid-step; --nvme gives every rank an NVMe tier (--host-budget: how much of its state stays
in DRAM)."""
import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from rank_launch import redirect_output



def batches(config, steps, rows, seq, seed=0):
    """Every step's global batch (all ranks' rows), two fixed batches in turn."""
    g = torch.Generator().manual_seed(seed)
    pair = [torch.randint(0, config.vocab_size, (rows, seq), generator=g) for _ in range(2)]
    return [pair[i % 2] for i in range(steps)]


def build(preset, seed=0, layers=None):
    from llama_zoo.torch_llama import LlamaForCausalLM, PRESETS
    import dataclasses
    config = PRESETS[preset]
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers)
    torch.manual_seed(seed)
    return config, LlamaForCausalLM(config)


def change_grads(model):
    """Elementwise changes of every grad between backward and step, the same on every rank:
    value clipping, then a mask of each parameter's shape (halves, ones and zeros)."""
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        mask = torch.randint(0, 3, p.shape, generator=gen).float() / 2
        if p.grad is not None:
            p.grad.mul_(mask.to(p.grad.device))


def loop(model, opt, data, rank, world, clip, fail=None, after=None, grad_ops=False,
         accumulate=1, norms=None):
    """The ordinary training loop on this rank's rows; the losses averaged over the ranks.
    after(step): called after each step. grad_ops: change_grads after each backward.
    accumulate: micro-batches per step (this rank's rows split evenly, each loss divided by
    their number); a step's loss is their mean. norms: a list that gets each step's
    clip_grad_norm_ result."""
    losses = []
    for step, ids in enumerate(data):
        rows = ids.shape[0] // world
        mine = ids[rank * rows:(rank + 1) * rows]
        if fail is not None and step == fail[0]:
            fail[1]()
        total = None
        for micro in mine.chunk(accumulate):
            loss = model(micro, labels=micro).loss
            (loss / accumulate).backward()
            part = loss.detach() / accumulate  # (exact for 1)
            total = part if total is None else total + part
        if grad_ops:
            change_grads(model)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
        if after is not None:
            after(step + 1)
    return losses


def grad_memory(model):
    """Where this rank's streamed grads and their sums are (collected after the run): the
    runtime's DRAM and HBM tiers' used bytes, the grad tensors' tier and bytes, the fp32
    gradient accumulators the optimizer made (their bytes: none with the sums in place), and
    the DRAM buffer HBM-homed fp32 sums are read through (strata_layout_totals_t's
    grad_fetch_bytes)."""
    import strata.core
    session = model.strata
    trained = [sp for entries in session.layers for sp in entries if sp.trainable]
    accum = 0
    for sp in trained:
        try:
            accum += session.optimizer.state(sp.weight, "grad_accum").nbytes
        except LookupError:
            pass
    element = torch.finfo(session.dtype).bits // 8
    counts = [[sp.weight.nbytes // element for sp in entries if sp.trainable]
              for entries in session.layers]
    return {"dram_used": session.runtime.tier_usage("dram")["used"],
            "hbm_used": session.runtime.tier_usage("hbm")["used"],
            "grad_tiers": sorted({sp.grad.info().tier for sp in trained}),
            "grad_dtypes": sorted({sp.grad.info().dtype for sp in trained}),
            "grad_bytes": sum(sp.grad.nbytes for sp in trained), "grad_tensors": len(trained),
            "accum_bytes": accum,
            "fetch_bytes": strata.core.grad_fetch_bytes(counts, element, "in_place"),
            "placement": session.placement()}


def nvme_options(args, model, nvme):
    """offload's NVMe options for this rank: the tier's path (--nvme-fault: the last rank's
    wrong), and the --host-budget for this rank's chunks of the blocks."""
    import strata.core
    from strata.torch import _planning
    from strata.torch._distributed import chunk_elements
    if args.nvme_fault is not None and args.rank == args.world - 1:
        if args.nvme_fault == "disagree":
            return {}
        nvme = os.path.join(os.path.dirname(nvme), "missing", "tier")
    options = {"nvme": nvme}
    if args.host_budget is None:
        return options
    shards = args.shard_size or args.world
    counts = [[chunk_elements(p.numel(), shards) if args.world > 1 else p.numel()
               for p in block.parameters()] for block in model.model.layers]
    dtype = getattr(torch, args.dtype)
    layers = strata.core.placement_layers(counts, torch.finfo(dtype).bits // 8,
                                          master_layout=_planning.master_layout(dtype))
    if args.host_budget in ("planned", "share"):
        first = len(layers) // 4
        budget = (sum(l["weight_bytes"] + l["grad_bytes"] for l in layers)
                  + sum(l["state_bytes"] for l in layers[:first])
                  + max(l["state_bytes"] for l in layers))
        if args.host_budget == "planned":
            options["host_budget"] = budget
            return options
        # The default host_budget, on a host whose available memory makes this rank's share
        # that budget; the next ranks see more (read at other times), and the ranks agree on
        # the least share.
        from strata.torch import _host
        available = int((budget + 1) * args.world / _planning.HOST_SHARE) + 1
        _host.mem_available = lambda: available * (1 + args.rank)
        options["expected_host_budget"] = int(available * _planning.HOST_SHARE) // args.world
        return options
    low, high = 0, strata.core.full_dram(layers)
    while low < high:
        mid = (low + high) // 2
        try:
            strata.core.place(layers, dram_budget=mid, nvme_budget=1 << 50)
            high = mid
        except MemoryError:
            low = mid + 1
    options["host_budget"] = low
    return options


def failure(kind):
    """What the failing rank does in the middle of a step: raise in a block's forward pass,
    die (SIGKILL), or stop (sleep) without calling collectives."""
    def arm(model):
        block = model.model.layers[1]
        run = block.forward

        def forward(*args, **kwargs):
            if kind == "raise":
                raise RuntimeError("injected failure in block 1's forward pass")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
            return run(*args, **kwargs)

        block.forward = forward
    return arm


def _torch_lion():
    from strata.torch.optim.resident import TorchLion  # torch has no Lion: lion-pytorch's formula
    return TorchLion


# name -> (strata.torch class, () -> the torch class DDP runs, lr -> settings)
OPTIMIZERS = {
    "adamw": ("AdamW", lambda: torch.optim.AdamW, lambda lr: dict(lr=lr, weight_decay=0.1)),
    "adam": ("Adam", lambda: torch.optim.Adam, lambda lr: dict(lr=lr, weight_decay=0.1)),
    "sgd": ("SGD", lambda: torch.optim.SGD,
            lambda lr: dict(lr=10 * lr, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "lion": ("Lion", _torch_lion, lambda lr: dict(lr=lr / 10, weight_decay=0.1)),
    "adagrad": ("Adagrad", lambda: torch.optim.Adagrad,
                lambda lr: dict(lr=lr, lr_decay=0.01, initial_accumulator_value=0.1)),
}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["strata", "ddp"], default="strata")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rows", type=int, default=4, help="rows of every step's global batch")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--accumulate", type=int, default=1,
                   help="micro-batches per step (each rank's rows split evenly); 'norms' in the "
                        "output: each step's clip_grad_norm_")
    p.add_argument("--grads", choices=["host", "device"], default="host",
                   help="offload(grads=); 'grad_memory' in the output: every rank's grad_memory")
    p.add_argument("--grad-dtype", choices=["float32", "bfloat16"], default=None,
                   help="offload(grad_dtype=) with --grads device")
    p.add_argument("--grads-fault", choices=["disagree"], default=None,
                   help="the last rank passes grads='host' whatever --grads says")
    p.add_argument("--grad-ops", action="store_true",
                   help="change the grads elementwise after each backward (change_grads)")
    p.add_argument("--shard-size", type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reduce-dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--fail", choices=["raise", "kill", "stall"], default=None)
    p.add_argument("--fail-step", type=int, default=1)
    p.add_argument("--resume-at", type=int, default=None,
                   help="save a checkpoint after this many steps, then train a fresh model "
                        "from it to the end: its losses go to the output as 'resumed'")
    p.add_argument("--weights-at", type=int, default=None,
                   help="save the weights alone after this many steps; after the run, load them "
                        "back without the optimizer: 'masters_follow' in the output says whether "
                        "every streamed master became its loaded weight")
    p.add_argument("--load-on-rank0", action="store_true",
                   help="rank 0 alone loads other weights into the model between offload and "
                        "the optimizer (DDP's usual pattern: rank 0 reads the checkpoint); "
                        "'residents_agree' in the output says whether the ranks' resident "
                        "masters are the same after the steps")
    p.add_argument("--gathered", action="store_true",
                   help="after the steps, read every parameter inside st.gathered (collective): "
                        "'gathered_is_state' says whether the values equal model.state_dict()'s; "
                        "the last rank alone writes inside gathered(writable=False): "
                        "'refused' says whether this rank refused it too; then block 0's "
                        "parameters are halved inside gathered(writable=True) on every rank")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                   help="strata.torch's optimizer of that name (DDP: torch's counterpart)")
    p.add_argument("--nvme", default=None,
                   help="an NVMe tier file path, the same on every rank (each rank's files are "
                        "<path>.rank<r>); the resumed model of --resume-at gets <path>-resumed")
    p.add_argument("--host-budget", choices=["least", "planned", "share"], default=None,
                   help="with --nvme: the least host_budget any placement of this rank's "
                        "chunks fits (their weights and state on NVMe); room for the "
                        "weights, the grads, the first quarter of the blocks' state and a "
                        "staging slot (the rest of the state on NVMe); or the default, on a "
                        "host whose available memory, shared by the ranks, makes it that")
    p.add_argument("--nvme-fault", choices=["unwritable", "disagree"], default=None,
                   help="with --nvme: the last rank's path is in a folder that does not exist, "
                        "or the last rank passes no nvme=")
    p.add_argument("--state-across-hosts", action="store_true",
                   help="DataParallel(state_across_hosts=True): the optimizer state sharded "
                        "across the replicas (processes standing in for hosts) too")
    p.add_argument("--state-across-hosts-fault", choices=["disagree", "resume_as_hsdp"],
                   default=None,
                   help="with --state-across-hosts: the last rank passes False, or the resumed "
                        "model of --resume-at trains without it (its load must be refused)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % args.port,
                            rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    # Ranks seeded differently: the broadcast from rank 0 must make them one model.
    config, model = build(args.preset, seed=args.rank if args.mode == "strata" else 0)
    data = batches(config, args.steps, args.rows, args.seq)
    checkpoint = None if args.out is None else args.out + ".ckpt"

    expected_host_budget = []  # per offload with --nvme --host-budget share: each rank's share
    own_choice = []  # per offload with --nvme: the placement this rank chose (its info)

    def strata_model(seed, nvme=args.nvme, across=args.state_across_hosts):
        import strata.torch as st
        _, fresh = build(args.preset, seed=seed)
        # One rank: the reference, no data parallelism.
        reduce_dtype = getattr(torch, args.reduce_dtype) if args.reduce_dtype else None
        tier = {}
        if nvme is not None:
            tier = nvme_options(args, fresh, nvme)
            expected_host_budget.append(tier.pop("expected_host_budget", None))
        if args.grads != "host" and not (args.grads_fault == "disagree" and
                                         args.rank == args.world - 1):
            tier["grads"] = args.grads
            if args.grad_dtype is not None:
                tier["grad_dtype"] = getattr(torch, args.grad_dtype)
        fresh = st.offload(fresh, device="cpu", dtype=getattr(torch, args.dtype),
                           data_parallel=st.DataParallel(
                               shard_size=args.shard_size, timeout=args.timeout,
                               reduce_dtype=reduce_dtype,
                               state_across_hosts=across)
                           if args.world > 1 else False, **tier)
        if nvme is not None:  # this rank's own choice, before the ranks adopt one
            own_choice.append(fresh.strata.placement_choice.info)
        if args.load_on_rank0 and args.rank == 0:
            fresh.load_state_dict(build(args.preset, seed=50)[1].state_dict())
        return fresh, getattr(st, OPTIMIZERS[args.optimizer][0])(
            fresh.parameters(), **OPTIMIZERS[args.optimizer][2](args.lr))

    after = None
    if args.mode == "strata":
        import strata.torch as st
        model, opt = strata_model(args.rank, across=args.state_across_hosts and not (
            args.state_across_hosts_fault == "disagree" and args.rank == args.world - 1))
        saved_weights = {}

        def after(step):
            if step == args.resume_at:
                st.save_checkpoint(checkpoint, model, opt)
            if step == args.weights_at:
                st.save_checkpoint(checkpoint + "-weights", model)
                saved_weights.update((k, v.clone()) for k, v in model.state_dict().items())
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = OPTIMIZERS[args.optimizer][1]()(model.parameters(),
                                               **OPTIMIZERS[args.optimizer][2](args.lr))
    fail = None
    if args.fail is not None and args.rank == args.world - 1:
        fail = (args.fail_step, lambda: failure(args.fail)(model))
    norms = []
    losses = loop(model, opt, data, args.rank, args.world, args.clip, fail, after,
                  args.grad_ops, args.accumulate, norms)
    refused = None
    if args.gathered:
        import strata.torch as st
        reference = model.state_dict()  # collective
        with st.gathered(model):
            values = {n: p.detach().clone() for n, p in model.named_parameters()}
        gathered_is_state = all(torch.equal(values[k], v) for k, v in reference.items()
                                if k in values)
        weight = next(model.model.layers[0].parameters())
        try:
            with st.gathered(model):
                if args.rank == args.world - 1:
                    weight.data.mul_(2.0)
            refused = False
        except RuntimeError as e:
            refused = "writable=True" in str(e)
        with st.gathered(model, writable=True):
            with torch.no_grad():
                for p in model.model.layers[0].parameters():
                    p.mul_(0.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # collective
    if args.mode == "ddp":
        state = {k[len("module."):]: v for k, v in state.items()}
    out = {"losses": losses, "state": state, "norms": norms}
    if args.mode == "strata":  # the elements this rank keeps optimizer state for
        stats = model.strata.optimizer.stats()
        out["elements"] = stats["elements"]
        layout = model.strata.layout
        every = [None] * args.world  # and every rank's state bytes and host replica bytes
        dist.all_gather_object(every, (stats["state_bytes"], 0 if getattr(
            layout, "replica", None) is None else layout.replica.host_bytes)) \
            if args.world > 1 else every.__setitem__(0, (stats["state_bytes"], 0))
        out["state_bytes"] = [b for b, _ in every]
        out["replica_bytes"] = [r for _, r in every]
        every = [None] * args.world
        mine = grad_memory(model)
        dist.all_gather_object(every, mine) if args.world > 1 else every.__setitem__(0, mine)
        out["grad_memory"] = every
    if args.nvme is not None:  # where every rank's state went, and its files
        session = model.strata
        every = [None] * args.world
        dist.all_gather_object(every, {
            "stats": session.optimizer.stats(), "placement": session.placement(),
            "homes": session.placement_choice.homes,
            "choice": session.placement_choice.info, "own_choice": own_choice[0],
            "weights_on_nvme": sum(sp.weight.info().tier == 2
                                   for entries in session.layers for sp in entries),
            "host_budget": session.runtime.capabilities().tier_budget_bytes[1],
            "expected_host_budget": expected_host_budget[0],
            "files": sorted(os.listdir(os.path.dirname(args.nvme)))})
        out["nvme"] = every
    if args.gathered:
        every = [None] * args.world
        dist.all_gather_object(every, refused)
        out["refused"] = every
        out["gathered_is_state"] = gathered_is_state
    if args.load_on_rank0:
        mine = [master.detach().cpu().clone() for _, master, _ in opt._residents.entries]
        every = [None] * args.world
        dist.all_gather_object(every, mine)
        out["residents_agree"] = all(
            all(torch.equal(a, b) for a, b in zip(every[0], other)) for other in every[1:])
    if args.weights_at is not None:
        st.load_checkpoint(checkpoint + "-weights", model)
        session = model.strata
        out["masters_follow"] = all(
            torch.equal(session.read_state(sp, "master"), saved_weights[sp.name].float())
            for entries in session.layers for sp in entries if sp.trainable)
    if args.resume_at is not None:
        # Another init (seed), then the checkpoint: the rest of the run again.
        resumed, resumed_opt = strata_model(
            100 + args.rank, None if args.nvme is None else args.nvme + "-resumed",
            args.state_across_hosts and args.state_across_hosts_fault != "resume_as_hsdp")
        st.load_checkpoint(checkpoint, resumed, resumed_opt)
        out["resumed"] = loop(resumed, resumed_opt, data[args.resume_at:], args.rank, args.world,
                              args.clip, grad_ops=args.grad_ops, accumulate=args.accumulate)
        out["resumed_state"] = {k: v.clone() for k, v in resumed.state_dict().items()}
        resumed.strata.close()
    if args.rank == 0 and args.out:
        torch.save(out, args.out)
    dist.barrier()
    if args.mode == "strata":
        model.strata.close()
    dist.destroy_process_group()


def entry(argv, log):
    """A rank started by multiprocessing (the test's forkserver, which imported torch and
    strata.torch once for all ranks): its output goes to the file `log`."""
    redirect_output(log)
    main(argv)


if __name__ == "__main__":
    # Run by hand: the model zoo (bench/llama_zoo), which pyproject.toml's pytest pythonpath
    # gives the ranks forked under pytest.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                    "bench"))
    sys.exit(main())
