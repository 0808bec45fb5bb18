#!/usr/bin/env python3
"""Data-parallel training throughput of Hugging Face Llama models streamed through Strata on
1 and N GPUs (issue 16), next to its peers on the same N GPUs in the same run (issue 39): PyTorch
FSDP2 with CPUOffloadPolicy, DeepSpeed ZeRO-3 offloading to the CPU and to NVMe
(ZeRO-Infinity), MegaTrain's data-parallel mode. Each configuration runs in its own job (so its
peak memory is its own; a job that outlives its time is killed with all its processes);
NCCL_NVLS_ENABLE=0 is set for every job.

    python bench/dist_bench.py --models 3.6b,8b --gpus 2 --batch 16 --seq 1024 --steps 3

Runs (--runs, comma-separated MODE:GPUS[:ROWS], ROWS in units of --batch per GPU, default 1):
    strata:1      one GPU, --batch rows per step       (the throughput baseline)
    strata:2      two GPUs, --batch rows each          (tokens/s >= 1.9x strata:1 is the goal)
    strata:1:2    one GPU, twice the rows              (the losses strata:2 must equal)
    fsdp2:2       FSDP2 + CPUOffloadPolicy, two GPUs, process group cuda:nccl,cpu:gloo (its
                  clip_grad_norm_ reduces over CPU-offloaded parameters)
    deepspeed:2   DeepSpeed ZeRO-3, params and optimizer offloaded to the CPU, two GPUs
    deepspeed-nvme:2  ZeRO-Infinity: params and optimizer state on NVMe (files under
                  --nvme-dir), two GPUs; reported as skipped where libaio is missing
    megatrain:2   MegaTrain's data-parallel mode (--megatrain-dir: its source tree, not part of
                  the repository; bench/megatrain_peer.py), --batch rows per GPU
Every job's ranks get --threads CPU threads each (default: the host's cores over its GPUs, the
per-process share that PyTorch's and DeepSpeed's docs recommend rather than torchrun's
OMP_NUM_THREADS=1), set as OMP_NUM_THREADS and torch.set_num_threads and reported; MegaTrain's
one optimizer process, which updates the whole model alone, gets that times its GPUs.
Every run trains on the same two batches in turn (random tokens, seeded), each rank on its
slice of the step's rows, from the same weights (a seeded init that every rank computes alike,
much faster than Hugging Face's for 8B; DeepSpeed's are its own, see setup_deepspeed), with
AdamW (lr 1e-4, weight decay 0.1), bf16, and clip_grad_norm_(model.parameters(), --clip) before
every step. Reported per run: tokens/s over
all GPUs, TFLOPS (6 P T / t) per GPU, median step time after warm-up, each step's loss (the mean
over all ranks' rows), peak host memory (VmHWM summed over ranks) and device memory (per GPU,
torch's peak plus Strata's HBM arena), setup time. Then per model: the scaling of strata over
GPUs, the largest relative loss difference between strata:N and strata:1:N, and strata:N
against each peer. --budget bounds the whole series: each run's time limit is what is left of
it, the slowest peers go last. --json and --markdown write the results and the summary.

Staged builds: set STRATA_LIBRARY to the libstrata.so to use (e.g. .gpubuild/new/libstrata.so.1);
bindings/python of this tree is put on the path. On a machine without GPUs, --device cpu runs
the same code on Strata's host backend under gloo, for checking the script (--models tiny).
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from host_memory import _proc_field, mem_available, peak_host_bytes  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

# Hugging Face Llama shapes (vocab 128256): "8b" is Llama 3.1 8B; "3.6b" is Llama 3.2 3B with an
# untied head (3.21 B + 0.39 B); "1b" Llama 3.2 1B's (untied: 1.5 B), for a quick check on GPUs;
# "tiny" checks the script on a CPU.
CONFIGS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "3.6b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                 rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               rope_theta=500000.0),
    # Issue 39 item 2a: the largest Llama a 4 x H200 host's DRAM and disk hold under data
    # parallelism (41.4B: Llama-3-70B's block shape, 46 of them; docs/benchmarks/data-parallel.md, "The
    # largest models on one GPU", for the arithmetic).
    "40b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=46, num_attention_heads=64, num_key_value_heads=8,
                rope_theta=500000.0),
    # Llama-3-70B's block shape, 16 and 20 of them (15.8B, 19.2B), for the 2 x H200 host
    # (256 GiB) what "40b" is for the 4-GPU one: with 4 micro-batches the 16b took 208 GB of
    # host memory with grads="host" and 166 GB with the gradient sums in HBM
    # (--strata-grads device); the 20b needs about 250 and 200 (docs/benchmarks/data-parallel.md).
    "16b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=16, num_attention_heads=64, num_key_value_heads=8,
                rope_theta=500000.0),
    "20b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_hidden_layers=20, num_attention_heads=64, num_key_value_heads=8,
                rope_theta=500000.0),
}


def hf_config(name):
    from transformers import LlamaConfig
    return LlamaConfig(**CONFIGS[name], max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, use_cache=False)


def parameters(config):
    h, i, v, n = (config.hidden_size, config.intermediate_size, config.vocab_size,
                  config.num_hidden_layers)
    kv = h // config.num_attention_heads * config.num_key_value_heads
    return n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h


_TILE = {}


def fast_init(module):
    """A seeded init every rank and every run computes alike, at memory speed: element k of a
    weight is element k mod 1,000,003 of one tile of normal values (std 0.02), norms are ones.
    Stands in for Hugging Face's _init_weights, which takes minutes for 8B parameters on the
    CPU. An FSDP2 parameter (a DTensor sharded on dim 0) gets its shard of the same values."""
    import torch
    from torch import nn
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.is_meta:
        return
    with torch.no_grad():
        local, start = weight, 0
        if hasattr(weight, "to_local"):  # FSDP2: rows [rank * ceil(R / W), ...) of the whole
            import torch.distributed as dist
            local = weight.to_local()
            rows = weight.shape[0]
            per = -(-rows // dist.get_world_size())
            start = min(dist.get_rank() * per, rows) * (weight.numel() // max(rows, 1))
        if "norm" in type(module).__name__.lower():
            local.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            key = (local.device, local.dtype)
            if key not in _TILE:
                g = torch.Generator().manual_seed(0)
                _TILE[key] = (torch.randn(1_000_003, generator=g) * 0.02).to(*key)
            tile, flat, pos = _TILE[key], local.view(-1), 0
            while pos < flat.numel():
                k = (start + pos) % tile.numel()
                n = min(tile.numel() - k, flat.numel() - pos)
                flat[pos:pos + n].copy_(tile[k:k + n])
                pos += n



def grow_host_memory(target):
    """Some VMs (the device machines here) give a guest its RAM as it is first touched: their
    MemAvailable starts far below the machine's memory, and Strata refuses a DRAM budget above
    MemAvailable. Touch what is missing in a child process (which then frees it), stopping
    early where memory does not grow (2 GiB left): never an OOM kill."""
    need = target - mem_available()
    if need <= 0:
        return 0.0
    t0 = time.perf_counter()
    code = ("import torch, sys\n"
            "sys.path.insert(0, %r)\n"
            "from host_memory import mem_available\n"
            "held, need = [], %d\n"
            "while sum(t.numel() for t in held) < need and mem_available() > (2 << 30):\n"
            "    held.append(torch.empty(min(1 << 30, need), dtype=torch.uint8).fill_(1))\n"
            % (str(pathlib.Path(__file__).parent), need))
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0



def data(config, rows, seq):
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (rows, seq), generator=g) for _ in range(2)]


# --- one run: a torchrun job, every rank in this function ------------------------------------

PROGRESS = "progress: "  # a rank 0 stderr line a step: what a run that timed out had done


def set_threads(threads):
    """This process's CPU threads (torch's intra-op pool, which OpenMP code in the process
    shares): the job's OMP_NUM_THREADS, set by the driver, would otherwise be torchrun's 1."""
    import torch
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def run_job(mode, model_name, rows_per_gpu, seq, steps, warmup, clip, device_kind,
            resident_blocks=None, threads=1, nvme_dir=None, accum=1, strata_nvme=None,
            strata_grads="host"):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    threads = set_threads(threads)
    if device_kind == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        # FSDP2's clip_grad_norm_ over CPU-offloaded parameters all-reduces CPU tensors: its
        # group needs a CPU backend beside NCCL.
        dist.init_process_group("cuda:nccl,cpu:gloo" if mode == "fsdp2" else "nccl",
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    config = hf_config(model_name)
    per_step = rows_per_gpu * accum  # rows a GPU takes in one optimizer step
    batches = data(config, per_step * world, seq)
    mine = [b[rank * per_step:(rank + 1) * per_step] for b in batches]
    out = {"mode": mode, "model": model_name, "params": parameters(config), "gpus": world,
           "rows_per_gpu": per_step, "micro_batches": accum, "seq": seq, "clip": clip,
           "cpu_threads": threads,
           "process_group": "cuda:nccl,cpu:gloo" if mode == "fsdp2" and device_kind == "cuda"
           else dist.get_backend()}
    if rank == 0:
        print("%s%s: %d ranks, %d CPU threads each, process group %s"
              % (PROGRESS, mode, world, threads, out["process_group"]), file=sys.stderr,
              flush=True)
    t_setup = time.perf_counter()
    step, extra = SETUPS[mode](config, device, clip, rows_per_gpu, world,
                               resident_blocks=resident_blocks, nvme_dir=nvme_dir, accum=accum,
                               strata_nvme=strata_nvme, strata_grads=strata_grads)
    out["setup_seconds"] = time.perf_counter() - t_setup
    times, losses = [], []
    for i in range(warmup + steps):
        ids = mine[i % 2].to(device, non_blocking=True)
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(ids).detach().float().reshape(())
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        sync(device)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
        if rank == 0:
            progress(i, warmup, elapsed, losses[-1], per_step * world * seq)
    measured(out, times, losses, per_step * world * seq, world)
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    out["peak_device_gb"] = (device_peak + extra.get("arena", 0)) / 1e9
    out.update({k: v for k, v in extra.items() if k not in ("arena", "close")})
    host = [None] * world
    dist.all_gather_object(host, peak_host_bytes())
    out["peak_host_gb"] = sum(host) / 1e9
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    if "close" in extra:
        extra["close"]()
    dist.destroy_process_group()


def progress(i, warmup, seconds, loss, tokens):
    print("%sstep %d%s %.3f s loss %.6f %.0f tokens/s" % (
        PROGRESS, i, " (warm-up)" if i < warmup else "", seconds, loss, tokens / seconds),
        file=sys.stderr, flush=True)


def measured(out, times, losses, tokens, gpus):
    """The step time (median of the measured steps), tokens/s and TFLOPS per GPU (6 P T / t)
    into out."""
    t = statistics.median(times)
    out.update(step_seconds=t, step_times=times, tokens_per_second=tokens / t,
               tflops_6pt_per_gpu=6 * out["params"] * tokens / t / 1e12 / gpus, losses=losses)


def run_megatrain_job(model_name, rows_per_gpu, gpus, seq, steps, warmup, clip, device_kind,
                      threads, megatrain_dir):
    """MegaTrain's data-parallel mode: not a torchrun job. One process (this one) holds the
    model on the CPU and steps the optimizer; MegaTrain spawns a worker process a GPU, each
    running its forward and backward pass on its contiguous rows_per_gpu of the step's rows.
    Its workers inherit OMP_NUM_THREADS (the per-GPU share); this process, which updates the
    whole model alone while the workers wait, gets the share of all its GPUs. Without CUDA:
    its dry run (megatrain_peer.dry_run), the configuration checked, nothing timed."""
    import torch
    import megatrain_peer
    megatrain_peer.load(megatrain_dir)  # a wrong tree refused before the model is built
    threads = set_threads(threads * gpus)
    config = hf_config(model_name)
    batches = data(config, rows_per_gpu * gpus, seq)
    out = {"mode": "megatrain", "model": model_name, "params": parameters(config), "gpus": gpus,
           "rows_per_gpu": rows_per_gpu, "seq": seq, "clip": clip,
           "cpu_threads": threads, "worker_cpu_threads": int(os.environ.get("OMP_NUM_THREADS",
                                                                            threads))}
    print("%smegatrain: %d worker processes, %d CPU threads each, %d in the optimizer's process"
          % (PROGRESS, gpus, out["worker_cpu_threads"], threads), file=sys.stderr, flush=True)
    t_setup = time.perf_counter()
    # The model on the CPU in bf16, as its train.py loads it, with every other run's weights.
    hf = meta_model(config)
    hf.to(torch.bfloat16)
    hf.to_empty(device="cpu")
    hf.apply(fast_init)
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=config)
    devices = list(range(gpus))
    if device_kind != "cuda":
        out.update(megatrain_peer.dry_run(megatrain_dir, hf, rows_per_gpu * gpus, seq, clip,
                                          devices))
        print(json.dumps(out), flush=True)
        return
    peer = megatrain_peer.setup(megatrain_dir, hf, rows_per_gpu * gpus, seq, clip, devices)
    del hf  # as its train.py does: CPUMasterModel holds the parts it trains
    out.update(peer.info)
    out["setup_seconds"] = time.perf_counter() - t_setup
    try:
        times, losses = [], []
        for i in range(warmup + steps):
            # No synchronize here: each of its steps waits for every worker's answer (the
            # forward-backward results, then the weights' sync), and a CUDA context in this
            # process would only take memory on every GPU.
            t0 = time.perf_counter()
            loss = float(peer.step(batches[i % 2]))
            elapsed = time.perf_counter() - t0
            losses.append(loss)
            if i >= warmup:
                times.append(elapsed)
            progress(i, warmup, elapsed, loss, rows_per_gpu * gpus * seq)
        measured(out, times, losses, rows_per_gpu * gpus * seq, gpus)
        out.update(peer.report(warmup))
        # This process's peak and its workers' (they hold the device buffers and copies of
        # what they stage); the shared-memory model counts in each process that touched it.
        workers = sum(_proc_field("/proc/%d/status" % pid, "VmHWM") for pid in peer.workers())
        out["peak_host_gb"] = (peak_host_bytes() + workers) / 1e9
        out["peak_device_gb"] = 0.0  # in the workers: not read from here
        print(json.dumps(out), flush=True)
    finally:
        peer.close()


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model, opt, clip, accum=1):
    """The ordinary PyTorch step both strata.torch and FSDP2 run: forward, backward (with accum
    > 1, gradient accumulation as users write it: the step's rows in accum equal micro-batches,
    each loss divided by accum before its backward), optional clip_grad_norm_, opt.step(),
    opt.zero_grad() (set_to_none, torch's default). Returns the step's mean loss."""
    import torch

    # STRATA_BENCH_PHASES=1: rank 0 prints where each step's time went (the device synchronized
    # at each boundary, so the phases' sum is a little over an unobserved step).
    phases = os.environ.get("STRATA_BENCH_PHASES") == "1" and \
        int(os.environ.get("RANK", 0)) == 0

    def mark(times):
        if phases:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    def step(ids):
        loss, times = 0.0, []
        mark(times)
        for micro in ids.chunk(accum):  # accum 1: the whole batch (a division by 1 is exact)
            part = model(micro, labels=micro).loss / accum
            part.backward()
            loss = loss + part.detach()
        mark(times)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        mark(times)
        opt.step()
        mark(times)
        opt.zero_grad()
        mark(times)
        if phases:
            spans = [b - a for a, b in zip(times, times[1:])]
            print("%sphases: forward+backward %.2f s, clip %.2f s, step %.2f s, zero_grad "
                  "%.2f s" % ((PROGRESS,) + tuple(spans)), file=sys.stderr, flush=True)
        return loss
    return step


def meta_model(config):
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model._init_weights = fast_init
    return model


def setup_strata(config, device, clip, rows, world, resident_blocks=None, accum=1,
                 strata_nvme=None, strata_grads="host", **_):
    import torch
    import strata.torch as st
    # The tier's file in the run's own directory (dist_bench's launch removes it after the run,
    # with whatever the ranks' files are named: under data parallelism the library names one
    # per rank after this path).
    nvme = None
    if strata_nvme:
        os.makedirs(strata_nvme, exist_ok=True)
        nvme = os.path.join(strata_nvme, "strata.tier")
    model = st.offload(meta_model(config), device=device, dtype=torch.bfloat16,
                       resident_blocks=resident_blocks, nvme=nvme, grads=strata_grads,
                       data_parallel=st.DataParallel(broadcast=False) if world > 1 else None)
    opt = st.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    info = model.strata.executor.plan_info()
    extra = {"resident_blocks": len(model.strata.resident_blocks),
             "plan": "%d slots of %.0f MB" % (info.slots, info.slot_bytes / 1e6),
             "optimizer_threads": model.strata.optimizer.stats()["threads"],
             "arena": model.strata.runtime.capabilities().tier_budget_bytes[0]
             if device.type == "cuda" else 0}
    if world > 1:
        extra["layout"] = model.strata.mesh.describe()
    # The arena's pinned part (what the GPU's copies touch), its use, and the blocks that went
    # to the other part for want of room (> 0: some of this rank's copies are pageable).
    dram = model.strata.runtime.tier_usage("dram")
    extra["dram_pinned_gb"] = [dram["pinned_used"] / 1e9, dram["pinned_budget"] / 1e9,
                               dram["budget"] / 1e9]
    extra["dram_fallbacks"] = dram["dram_fallbacks"]
    if nvme:
        extra["nvme"] = nvme

    extra["close"] = model.strata.close

    return plain_step(model, opt, clip, accum), extra


def setup_fsdp2(config, device, clip, rows, world, accum=1, **_):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from train_bench import checkpoint_blocks
    model = meta_model(config)
    checkpoint_blocks(model, "hf")
    policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
    if device.type == "cuda":
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in model.model.layers:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu" if device.type == "cuda" else device)
    model.apply(fast_init)
    # to_empty leaves non-persistent buffers (rotary inv_freq) uninitialized: computed again.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    return plain_step(model, opt, clip, accum), {
        "plan": "FSDP2 fully_shard per block and the model, CPUOffloadPolicy(pin_memory=True), "
                "bf16 params, fp32 reduce, blocks checkpointed; torch.optim.AdamW on the CPU"
        if device.type == "cuda" else "FSDP2 fully_shard on the CPU (no offload)"}


def setup_deepspeed(config, device, clip, rows, world, nvme_dir=None, **_):
    """DeepSpeed ZeRO-3 (bench/deepspeed_peer.py's configuration), offloading to the CPU, or
    to NVMe under nvme_dir (ZeRO-Infinity), its model built partitioned under zero.Init on the
    GPUs with Hugging Face's own init (quick there; fast_init cannot reach the partitions zero.Init
    makes as each module is built): its losses start from other weights than the other runs'."""
    import deepspeed
    import torch
    import deepspeed_peer
    from transformers import LlamaForCausalLM
    from train_bench import checkpoint_blocks
    largest = max(config.vocab_size * config.hidden_size,
                  config.hidden_size * config.intermediate_size)
    ds_config = deepspeed_peer.config(rows, clip, nvme_path=nvme_dir, largest_param=largest)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                              dtype=torch.bfloat16)
    checkpoint_blocks(model, "hf")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    def step(ids):
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    zero = ds_config["zero_optimization"]
    return step, {"deepspeed": deepspeed.__version__,
                  "plan": "ZeRO-3, params to %s, optimizer to %s, %s, blocks checkpointed" % (
                      zero["offload_param"]["device"], zero["offload_optimizer"]["device"],
                      type(engine.optimizer.optimizer).__name__
                      if hasattr(engine.optimizer, "optimizer") else "its CPU Adam")}


SETUPS = {"strata": setup_strata, "fsdp2": setup_fsdp2, "deepspeed": setup_deepspeed,
          "deepspeed-nvme": setup_deepspeed}
# Every mode a run can name: MegaTrain's is no torchrun job (run_megatrain_job).
MODES = tuple(SETUPS) + ("megatrain",)
# The peers strata:N is compared with, in the order a series runs them after Strata's runs:
# slowest last, so that a series cut short by --budget loses the least.
PEERS = ("megatrain", "deepspeed", "fsdp2", "deepspeed-nvme")


# --- the driver ------------------------------------------------------------------------------

def parse_run(spec):
    parts = spec.split(":")
    if parts[0] not in MODES or not 2 <= len(parts) <= 3:
        raise ValueError("run %r: MODE:GPUS[:ROWS] with MODE in %s" % (spec, sorted(MODES)))
    gpus, mult = int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
    if gpus < 1 or mult < 1:
        raise ValueError("run %r: GPUS and ROWS are at least 1" % spec)
    if parts[0] != "strata" and mult != 1:
        raise ValueError("run %r: ROWS is for strata's loss references only" % spec)
    return parts[0], gpus, mult


def default_runs(n):
    """Strata's baseline, its N-GPU run and the loss reference, then every peer on N GPUs,
    slowest last."""
    return "strata:1,strata:%d,strata:1:%d," % (n, n) + ",".join("%s:%d" % (m, n) for m in PEERS)


def host_cores():
    return len(os.sched_getaffinity(0))


def threads_per_rank(args, runs):
    """--threads, else the host's cores over its GPUs (with --device cpu: over the most ranks
    a run has): what one process a GPU gets when every process of the host gets its share."""
    if args.threads:
        return args.threads
    if args.device == "cuda":
        gpus = args.host_gpus or max(g for _, g, _ in runs)
    else:
        gpus = max(g for _, g, _ in runs)
    return max(1, host_cores() // max(1, gpus))


def unavailable(mode, args, ds):
    """Why a run of `mode` cannot run here (a string), or None. ds: deepspeed_peer.status()."""
    if mode in ("deepspeed", "deepspeed-nvme"):
        if args.device != "cuda":
            return "DeepSpeed's offload needs CUDA"
        import deepspeed_peer
        return deepspeed_peer.unavailable(mode, ds)
    if mode == "megatrain" and not args.megatrain_dir:
        return "no --megatrain-dir (MegaTrain's source tree is not part of the repository)"
    return None


def job_command(args, mode, gpus, mult, model_name, threads, nvme_dir=None):
    """The command line of one run: a torchrun job of `gpus` ranks, or for MegaTrain one process
    that spawns its own workers."""
    one = [__file__, "--one", mode, model_name, "--batch", str(args.batch * mult),
           "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--clip", str(args.clip), "--device", args.device, "--threads", str(threads)]
    if args.resident_blocks is not None and mode == "strata":
        one += ["--resident-blocks", str(args.resident_blocks)]
    if args.accum > 1:
        one += ["--accum", str(args.accum)]
    if nvme_dir and mode == "strata":
        one += ["--strata-nvme", nvme_dir]
    if args.strata_grads != "host" and mode == "strata":
        one += ["--strata-grads", args.strata_grads]
    if mode == "megatrain":
        return [sys.executable] + one + ["--gpus", str(gpus), "--megatrain-dir",
                                         os.path.abspath(args.megatrain_dir)]
    if nvme_dir and mode == "deepspeed-nvme":
        one += ["--nvme-dir", nvme_dir]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(gpus)] + one


def job_env(threads):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"),
                                                      str(ROOT / "bench"),
                                                      env.get("PYTHONPATH")]))
    return env


def kill_group(proc):
    """The job and every process it started (torchrun's ranks, MegaTrain's workers, compilers):
    SIGTERM, then SIGKILL what is left after 10 s. They run in their own session."""
    import signal
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


# A traceback's last line, "[rankN]: " prefix allowed: an exception's (dotted) class name, then
# its message. Strata's exceptions are named for their status (strata.errors.OutOfMemory), not
# ...Error, so the class is matched by its shape, not by its name's ending.
_RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*: \S.*)$")


def first_error(stderr, returncode):
    """The first exception a rank raised, rather than torchrun's summary of it (or its own
    progress lines)."""
    err = stderr.strip().splitlines()
    raised = [m.group(1) for m in map(_RAISED.match, err)
              if m and "elastic" not in m.group(1) and "ChildFailedError" not in m.group(1)]
    return (raised or err or ["exit %d" % returncode])[0][:400]


def from_progress(stderr, warmup, tokens):
    """What the progress lines of a run that was stopped say: its measured steps so far."""
    times, losses = [], []
    for line in stderr.splitlines():
        if line.startswith(PROGRESS + "step "):
            words = line[len(PROGRESS):].split()
            i, seconds = int(words[1]), float(words[-6])
            losses.append(float(words[-3]))
            if i >= warmup:
                times.append(seconds)
    return times, losses


def launch(args, mode, gpus, mult, model_name, threads, timeout, log=None):
    nvme_dir = None
    if mode == "deepspeed-nvme" or (mode == "strata" and args.strata_nvme):
        # A directory of this run's own under the one given, removed after it however it ends
        # (strata's tier files are per rank, named by the library under data parallelism).
        root = args.nvme_dir if mode == "deepspeed-nvme" else args.strata_nvme
        nvme_dir = os.path.join(os.path.abspath(root), "dist_bench.%d.%s-%d" % (
            os.getpid(), mode, gpus))
        os.makedirs(nvme_dir, exist_ok=True)
    cmd = job_command(args, mode, gpus, mult, model_name, threads, nvme_dir)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(threads), start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        stdout, stderr = proc.communicate()
    finally:
        if nvme_dir:
            # Its swap files (tens of GB) would otherwise crowd the next run off the disk.
            import shutil
            shutil.rmtree(nvme_dir, ignore_errors=True)
    if log:
        pathlib.Path(log).write_text("$ %s\n--- stdout\n%s\n--- stderr\n%s" % (
            " ".join(cmd), stdout, stderr))
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if timed_out:
        result = {"error": "timed out after %d s" % timeout}
        times, losses = from_progress(stderr, args.warmup,
                                      args.batch * args.accum * mult * gpus * args.seq)
        if times:  # what it measured before the limit: reported as such
            params = parameters(hf_config(model_name))
            result.update(params=params, partial="%d measured steps before the time limit"
                          % len(times))
            measured(result, times, losses, args.batch * args.accum * mult * gpus * args.seq,
                     gpus)
        elif losses:
            result["losses"] = losses
        result["last_output"] = stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
        return result
    if lines and proc.returncode != 0:  # measured, then failed on the way out: say so
        result = json.loads(lines[-1])
        result["exit"] = "exit code %d after the results" % proc.returncode
        return result
    if proc.returncode != 0 or not lines:
        return {"error": first_error(stderr, proc.returncode)}
    return json.loads(lines[-1])


def max_relative(a, b):
    pairs = list(zip(a or [], b or []))
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)


# The largest relative loss difference still "equal within bf16 tolerance": bf16's unit
# roundoff (2^-8), the rounding of one bf16 value.
BF16_TOLERANCE = 2.0 ** -8


def summarize(results, models, gpus):
    lines = []
    for m in models:
        by = {(r["mode"], r["gpus"], r.get("mult", 1)): r for r in results
              if r["model"] == m and "tokens_per_second" in r and "partial" not in r}
        one, many, double = by.get(("strata", 1, 1)), by.get(("strata", gpus, 1)), \
            by.get(("strata", 1, gpus))
        if one and many:
            lines.append("%-5s strata %d GPUs / 1 GPU = %.3f (tokens/s, same rows per GPU; "
                         "goal >= %.1f)" % (m, gpus, many["tokens_per_second"] /
                                            one["tokens_per_second"], 0.95 * gpus))
        if many and double:
            worst = max_relative(many["losses"], double["losses"])
            lines.append("%-5s strata losses, %d GPUs vs 1 GPU with %dx the rows: largest "
                         "relative difference %.2e (%s bf16's 2^-8)" % (
                             m, gpus, gpus, worst,
                             "within" if worst <= BF16_TOLERANCE else "NOT within"))
        for peer in PEERS:
            p = by.get((peer, gpus, 1))
            if many and p:
                lines.append("%-5s strata / %-14s on %d GPUs = %.3f (tokens/s; goal >= 3)" % (
                    m, peer, gpus, many["tokens_per_second"] / p["tokens_per_second"]))
        mt = by.get(("megatrain", gpus, 1))
        if mt and double:  # the same weights and rows: its losses should follow Strata's
            worst = max_relative(mt["losses"], double["losses"])
            lines.append("%-5s megatrain losses vs strata 1 GPU with %dx the rows: largest "
                         "relative difference %s" % (m, gpus, "%.2e" % worst
                                                     if worst == worst else "nan"))
    return lines


def run_name(mode, gpus, mult):
    return "%s:%d%s" % (mode, gpus, ":%d" % mult if mult != 1 else "")


def describe(model_name, r):
    name = run_name(r["mode"], r["gpus"], r.get("mult", 1))
    if "skipped" in r:
        return "%-5s %-17s skipped: %s" % (model_name, name, r["skipped"])
    if "dry_run" in r:
        return "%-5s %-17s dry run: %s" % (model_name, name, r["dry_run"])
    if "tokens_per_second" not in r:
        return "%-5s %-17s failed: %s" % (model_name, name, r["error"])
    return ("%-5s %-17s %8.0f tokens/s  %6.1f TFLOPS/GPU (6PT/t)  step %.2f s  host %.1f GB  "
            "device %.1f GB/GPU  setup %.0f s  threads %s  losses %s %s%s" % (
                model_name, name, r["tokens_per_second"], r["tflops_6pt_per_gpu"],
                r["step_seconds"], r.get("peak_host_gb", 0), r.get("peak_device_gb", 0),
                r.get("setup_seconds", 0), r.get("cpu_threads", "?"),
                " ".join("%.4f" % x for x in r["losses"]), r.get("layout", ""),
                "  [%s: %s]" % (r["error"], r["partial"]) if "partial" in r else ""))


def markdown(results, summary, header):
    rows = ["| run | tokens/s | TFLOPS/GPU (6PT/t) | step s | setup s | CPU threads | "
            "host GB | losses |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = "%s %s" % (r["model"], run_name(r["mode"], r["gpus"], r.get("mult", 1)))
        if "tokens_per_second" in r:
            rows.append("| %s%s | %.0f | %.1f | %.2f | %.0f | %s | %.1f | %s |" % (
                name, " (partial: %s)" % r["partial"] if "partial" in r else "",
                r["tokens_per_second"], r["tflops_6pt_per_gpu"], r["step_seconds"],
                r.get("setup_seconds", 0), r.get("cpu_threads", ""), r.get("peak_host_gb", 0),
                " ".join("%.4f" % x for x in r["losses"])))
        else:
            why = r.get("skipped") and "skipped: " + r["skipped"] or r.get("dry_run") \
                or "failed: " + r.get("error", "?")
            rows.append("| %s | %s | | | | | | |" % (name, why.replace("|", "/")))
    return "\n".join(header + [""] + rows + [""] + ["- " + line for line in summary]) + "\n"


def add_step_options(p):
    """The options of a measured step every data-parallel bench takes (this one, dist_hosts):
    rows per GPU, sequence, timed and warm-up steps, clipping, device."""
    p.add_argument("--batch", type=int, default=16, help="rows per GPU per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")


# The modes whose step (plain_step) accumulates --accum micro-batches. DeepSpeed takes
# accumulation in its config and MegaTrain in its own; neither is wired here, and one batch of
# batch x accum rows would measure another step.
ACCUMULATES = ("strata", "fsdp2")


def check_accum(p, args, modes):
    """--accum's rules for the runs of `modes`, refused through the parser p."""
    if args.accum < 1:
        p.error("--accum %d: at least 1 micro-batch a step" % args.accum)
    if args.accum > 1 and any(m not in ACCUMULATES for m in modes):
        p.error("--accum %d: only strata and fsdp2 runs accumulate here (runs: %s)"
                % (args.accum, ",".join(modes)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="3.6b,8b")
    p.add_argument("--gpus", type=int, default=2, help="N in the default runs")
    p.add_argument("--runs", default=None,
                   help="MODE:GPUS[:ROWS] list (default strata:1,strata:N,strata:1:N, then "
                        "megatrain,deepspeed,fsdp2,deepspeed-nvme on N GPUs)")
    add_step_options(p)
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="strata: blocks kept in HBM (default: strata.torch.offload's choice)")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches of --batch rows per GPU in each optimizer step "
                        "(strata, fsdp2; gradient accumulation as users write it)")
    p.add_argument("--strata-nvme", default=None,
                   help="strata: a directory for an NVMe tier, one file a rank "
                        "(st.offload(nvme=...): the state DRAM cannot hold goes there)")
    p.add_argument("--strata-grads", choices=["host", "device"], default="host",
                   help="strata: where the streamed blocks' grads live (st.offload(grads=...)); "
                        "under data parallelism 'device' keeps each rank's fp32 gradient sums "
                        "in HBM, added to in place (no DRAM grads, no accumulators)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of each rank (default: the host's cores over its GPUs)")
    p.add_argument("--host-gpus", type=int, default=0,
                   help="GPUs of the host, for --threads' default (default: the most a run has)")
    p.add_argument("--megatrain-dir", default=None,
                   help="MegaTrain's source tree (its infinity package), for megatrain runs")
    p.add_argument("--nvme-dir", default=str(ROOT / ".dist_bench_nvme"),
                   help="deepspeed-nvme: its swap files go to a directory under this one "
                        "(removed after the run)")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds per run at most")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole series (0: none); each run's limit is what is "
                        "left of it, a run with less than --min-run seconds left is skipped")
    p.add_argument("--min-run", type=float, default=45)
    p.add_argument("--host-memory", type=float, default=0,
                   help="GB of MemAvailable to make sure of first, touching memory where the "
                        "VM grows its RAM on demand (nvidia-h200-x2 starts at ~31 GiB)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--markdown", default=None, help="also write a table and the summary here")
    p.add_argument("--logs", default=None, help="a directory for each run's output")
    p.add_argument("--plan", action="store_true",
                   help="print the runs, their threads and what is unavailable; run nothing")
    p.add_argument("--one", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        check_accum(p, args, [args.one[0]])
        if args.one[0] == "megatrain":
            run_megatrain_job(args.one[1], args.batch, args.gpus, args.seq, args.steps,
                              args.warmup, args.clip, args.device, args.threads,
                              args.megatrain_dir)
        else:
            run_job(args.one[0], args.one[1], args.batch, args.seq, args.steps, args.warmup,
                    args.clip, args.device, args.resident_blocks, max(1, args.threads),
                    args.nvme_dir if args.one[0] == "deepspeed-nvme" else None,
                    args.accum, args.strata_nvme, args.strata_grads)
        return
    t_start = time.perf_counter()
    n = args.gpus
    try:
        runs = [parse_run(s) for s in (args.runs or default_runs(n)).split(",")]
    except ValueError as e:
        p.error(str(e))
    check_accum(p, args, [m for m, _, _ in runs])
    if args.megatrain_dir:
        import megatrain_peer
        megatrain_peer.load(args.megatrain_dir)  # a wrong tree refused before anything runs
    models = args.models.split(",")
    threads = threads_per_rank(args, runs)
    print("CPU threads: %d a rank (%d cores on this host; OMP_NUM_THREADS and "
          "torch.set_num_threads in every job)" % (threads, host_cores()), flush=True)
    ds = {}
    if any(m.startswith("deepspeed") or m == "megatrain" for m, _, _ in runs) \
            and not args.plan and args.device == "cuda":
        # DeepSpeed's ops built once, before any run (MegaTrain steps DeepSpeedCPUAdam too).
        import deepspeed_peer
        ds = deepspeed_peer.status(build=True, timeout=int(min(300, args.budget / 2))
                                   if args.budget else 300,
                                   aio=any(m == "deepspeed-nvme" for m, _, _ in runs))
        print("deepspeed: %s" % json.dumps(ds), flush=True)
    if any(m == "deepspeed-nvme" for m, _, _ in runs) and not args.plan \
            and unavailable("deepspeed-nvme", args, ds):
        print("ZeRO-Infinity: skipped, %s" % unavailable("deepspeed-nvme", args, ds), flush=True)
    if args.plan:
        for mode, gpus, mult in runs:
            why = "DeepSpeed and libaio checked when it runs" if mode.startswith(
                "deepspeed") and args.device == "cuda" else unavailable(mode, args, ds)
            print("%-17s threads %d%s" % (run_name(mode, gpus, mult),
                                          threads * gpus if mode == "megatrain" else threads,
                                          "  unavailable: " + why if why and "checked" not in why
                                          else "  (%s)" % why if why else ""), flush=True)
        return
    if args.host_memory:
        seconds = grow_host_memory(int(args.host_memory * 1e9))
        print("host memory: %.0f GB available (%.0f s to grow it; %.0f GB asked for)"
              % (mem_available() / 1e9, seconds, args.host_memory), flush=True)
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    results = []
    for model_name in models:
        for mode, gpus, mult in runs:
            left = args.budget - (time.perf_counter() - t_start) if args.budget else None
            why = unavailable(mode, args, ds)
            if why is None and left is not None and left < args.min_run:
                why = "no time left (%.0f s of --budget %.0f)" % (max(left, 0), args.budget)
            t0 = time.perf_counter()
            if why:
                r = {"skipped": why}
            else:
                timeout = int(min(args.run_timeout, left) if left is not None
                              else args.run_timeout)
                log = os.path.join(args.logs, "%s_%s.log" % (
                    model_name, run_name(mode, gpus, mult).replace(":", "-"))) \
                    if args.logs else None
                r = launch(args, mode, gpus, mult, model_name, threads, timeout, log)
            r.update(mode=mode, model=model_name, gpus=gpus, mult=mult,
                     wall_seconds=time.perf_counter() - t0)
            results.append(r)
            print(describe(model_name, r), flush=True)
    summary = summarize(results, models, n)
    for line in summary:
        print(line, flush=True)
    print("series: %.0f s" % (time.perf_counter() - t_start), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"threads_per_rank": threads, "host_cores": host_cores(), "deepspeed": ds,
             "results": results, "summary": summary}, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown(results, summary, [
            "# bench/dist_bench.py: %s, %d x %d tokens per GPU%s, clip %g, %d CPU threads a rank"
            % (",".join(models), args.batch * args.accum, args.seq,
               " (%d micro-batches of %d rows)" % (args.accum, args.batch) if args.accum > 1
               else "", args.clip, threads)]))


if __name__ == "__main__":
    main()
