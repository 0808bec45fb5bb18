"""One data-parallel run of bench/dist_bench.py, every rank in run_job (or MegaTrain's one
process in run_megatrain_job): the model shapes, the seeded data and init, the setup of strata
and each peer, the step, and what a job reports of its steps."""
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from bench_models import checkpoint_blocks, fast_init  # noqa: E402
from host_memory import _proc_field, peak_host_bytes  # noqa: E402

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
    # parallelism (41.4B: Llama-3-70B's block shape, 46 of them; docs/benchmarks/nvme.md, "The
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
