#!/usr/bin/env python3
"""Training throughput of Llama models streamed through Strata, next to the same model fully
resident in HBM, PyTorch FSDP2 with CPU offload, DeepSpeed ZeRO-3 and MegaTrain, with the same
tokens per step, in the same run (each configuration in its own process, so peak memory is its
own).

The model is Hugging Face's LlamaForCausalLM (--impl hf, the default: sdpa attention, the model
users train), trained as the README shows: built on the meta device from its config,
st.offload(model, dtype=torch.bfloat16), st.AdamW(model.parameters()), the loss from
model(ids, labels=ids), clip_grad_norm_(model.parameters(), --clip). --impl zoo trains the
package's own Llama of bench/llama_zoo instead (the same shapes). The Hugging Face model's
weights come from bench_models.fast_init (seeded, the same in every mode and in MegaTrain's, but
DeepSpeed's, which initializes its partitions as it builds them), AdamW lr 1e-4, weight decay
0.1, random tokens (two seeded batches in turn).

Reports per configuration: the median step time after warm-up, every step's seconds and loss,
tokens/s, TFLOPS by two counts (6 P T / t with P every parameter, the embedding and the head
included, as bench/dist_bench.py and MegaTrain's train.py count; and the work actually done:
recomputation and causal attention included, see llama_zoo.flops_per_token), the placement
strata.torch chose (model.strata.placement()), peak host memory (VmHWM) and device memory.
A line of human summary per configuration on stdout; --jsonl FILE appends each configuration's
result as one JSON line as soon as it is measured (--json FILE: all of them at the end).

    python bench/train_bench.py --models 8b --modes strata --batch 148 --seq 1024 --clip 1.0
    python bench/train_bench.py --models 8b --modes strata --batch 148 --seq 1024 --accum 4 \
        --clip 1.0                                  # 4 micro-batches of 37
    python bench/train_bench.py --models 8b --modes strata --peer megatrain \
        --megatrain-dir .stage/megatrain/src --batch 148 --seq 1024 --clip 1.0
    python bench/train_bench.py --models tiny --modes strata --device cpu --batch 4 --seq 64

--peer megatrain (with --megatrain-dir DIR, MegaTrain's source tree: it is not part of this
repository) runs MegaTrain (github.com/DLYuanGod/MegaTrain) on the same model, batch, steps and
clip after the --modes, in its own process, driven through its Python API as its
examples/sft/train.py does (CPUMasterModel.forward_and_backward, clip_grad_norm_ over
get_parameters(), DeepSpeedCPUAdam where DeepSpeed is installed, else torch's AdamW, then
_sync_params_to_gpu and zero_grad), timed by the same loop as every other mode (bench/
megatrain_peer.py). It needs CUDA; --dry-run checks its import, configuration and the
attention-mask patch it needs for sdpa on the CPU instead of training.

--nvme PATH (strata only) gives the runtime an NVMe tier there: optimizer state that does not
fit in --host-budget GiB (default: 85% of MemAvailable) goes to NVMe, staged through DRAM
(docs/optimizer.md), and so do the last blocks' weights when the budget cannot hold them; the
result reports the placement, the NVMe traffic per step and the DRAM arena per streamed
parameter (and its pinned part).
A model is a preset name or a spec "h4096-l40-i14336-kv8-v32000" (hidden, layers, FFN,
KV heads, vocabulary; 32 heads of 128).

--modes deepspeed-nvme runs the peer of issue 14, DeepSpeed ZeRO-Infinity (ZeRO-3 with parameters
and optimizer state offloaded to NVMe, in PATH.deepspeed beside --nvme PATH); deepspeed-cpu
offloads them to DRAM instead (docs/benchmarks/nvme.md says how to run it where DeepSpeed and
libaio are not installed).

--clip N clips every configuration with torch.nn.utils.clip_grad_norm_(model.parameters(), N)
between backward and step, as LLM recipes do (strata.torch included: its streamed grads take
part in the global norm).

--accum N splits each step's batch into N micro-batches whose grads accumulate before the step
(gradient accumulation; every mode but DeepSpeed's, whose config sets its own): the same
tokens per step, with each forward pass's memory that of a micro-batch.
"""
import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from bench_models import build_model, checkpoint_blocks, materialize, model_config  # noqa: E402 (bench/ is on sys.path when run)
from host_memory import grow_host_memory, huge_page_bytes  # noqa: E402
from train_measure import PROGRESS, measure  # noqa: E402
from train_modes import accumulation, engine_step, plain_step, setup_deepspeed  # noqa: E402




def run_one(mode, preset, batch, seq, steps, warmup, clip=0.0, resident_blocks=None, nvme=None,
            host_budget=None, trace=None, weights=None, impl="hf", megatrain_dir=None,
            dry_run=False):
    import torch

    config = model_config(preset)
    config = dataclasses.replace(config)  # a preset is shared: the loss is this run's
    config.loss_impl = os.environ.get("STRATA_BENCH_LOSS", "torch")
    opt = None  # the optimizer, where the mode has one of its own
    # STRATA_BENCH_DEVICE=cpu: a dry run of the script on a machine without a GPU.
    device = torch.device(os.environ.get("STRATA_BENCH_DEVICE", "cuda"))
    cuda = device.type == "cuda"
    # Every mode on the allocator strata.torch.offload sets up (expandable segments unless the
    # environment says otherwise), so the resident and DeepSpeed modes are measured alike.
    from strata.torch._allocator import prefer_expandable_segments
    prefer_expandable_segments(device)
    torch.manual_seed(0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (batch, seq), generator=gen) for _ in range(2)]
    marks = []  # (phase, host time, device event) of the running step

    def mark(name):
        event = None
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        marks.append((name, time.perf_counter(), event))

    out = {"mode": mode, "model": preset, "impl": "megatrain" if mode == "megatrain" else impl,
           "params": config.parameters(), "batch": batch, "seq": seq,
           "accum": accumulation(), "tokens_per_step": batch * seq,
           "clip": clip, "loss": config.loss_impl, "device": str(device),
           # What tflops_6pt counts (bench/dist_bench.py's and MegaTrain's convention).
           "flops_count": "6*P*T/t, P = every parameter (embedding and head included)"}
    if cuda:
        out["device_name"] = torch.cuda.get_device_name()
    t_setup = time.perf_counter()
    if mode == "megatrain":
        # MegaTrain's own training, driven through its Python API (bench/megatrain_peer.py).
        # The model on the CPU in bf16, as its train.py loads it, with every other mode's
        # weights (fast_init).
        import megatrain_peer
        megatrain_peer.load(megatrain_dir)  # a wrong tree refused before the model is built
        hf = build_model(config, "hf", "meta", dtype=torch.bfloat16)
        materialize(hf, "cpu")
        if dry_run:
            out.update(megatrain_peer.dry_run(megatrain_dir, hf, batch, seq, clip))
            return out
        peer = megatrain_peer.setup(megatrain_dir, hf, batch, seq, clip)
        del hf  # as its train.py does: CPUMasterModel holds the parts it trains
        out.update(peer.info)
        out["setup_seconds"] = time.perf_counter() - t_setup
        try:
            result = measure(out, mode, preset, config, None, peer.step, data, device, cuda,
                              marks, steps, warmup, batch, seq, trace, nvme, None)
            result.update(peer.report(warmup))
            return result
        finally:
            peer.close()
    if mode == "strata-separate":
        # strata with whole fp32 masters (strata.h STRATA_MASTER_SEPARATE) instead of split
        # ones: the layout before, for comparison in the same run.
        import strata.torch._planning
        strata.torch._planning.master_layout = lambda dtype: "separate"
        mode = "strata"
    grads = "host"
    if mode == "strata-device-grads":
        # The streamed blocks' grads in HBM (offload(grads="device"): 12 bytes per parameter
        # of DRAM instead of 14), the optimizer reading them from there.
        grads, mode = "device", "strata"
    if mode == "strata":
        import strata.torch as st
        model = build_model(config, impl, "meta")  # the README's road: built on meta
        # The setup in three parts (setup_split): the model on meta (transformers' import
        # included), st.offload, st.AdamW; setup_phases splits the last two further.
        t_offload = time.perf_counter()
        model = st.offload(model, device=device, dtype=torch.bfloat16,
                           resident_blocks=resident_blocks, nvme=nvme,
                           host_budget=int(host_budget * (1 << 30)) if host_budget else None,
                           weights=weights, grads=grads,
                           # STRATA_BENCH_SLOT_BUDGET (GiB): the executor's slots (how many
                           # blocks load ahead), for A/B runs; default: the planner's choice.
                           slot_budget=int(float(os.environ.get("STRATA_BENCH_SLOT_BUDGET", "0"))
                                           * (1 << 30)),
                           # STRATA_BENCH_SPILL: on / off forces offload(spill_checkpoints=)
                           # for A/B runs; default: automatic.
                           spill_checkpoints={"on": True, "off": False}.get(
                               os.environ.get("STRATA_BENCH_SPILL", "auto")))
        paged = os.environ.get("STRATA_BENCH_PAGED_STATE")
        if paged is not None:  # --paged-state: an A/B of strata.torch.paging
            st.AdamW.PAGED_STATE = {"all": None, "auto": "auto"}.get(paged) if \
                paged in ("all", "auto") else int(paged)
        t_optimizer = time.perf_counter()
        opt = st.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                       threads=int(os.environ.get("STRATA_BENCH_OPTIMIZER_THREADS", "0")))
        out["setup_split"] = {"build": t_offload - t_setup, "offload": t_optimizer - t_offload,
                              "optimizer": time.perf_counter() - t_optimizer}
        if nvme:
            out["placement"] = model.strata.placement()
        info = model.strata.executor.plan_info()
        out["resident_blocks"] = len(model.strata.resident_blocks)
        out["setup_phases"] = model.strata.setup_seconds  # updated by the optimizer's build
        caps = model.strata.runtime.capabilities()
        # Within "runtime": faulting the DRAM arena in (threaded) and what pinning added after
        # it (the two overlap: docs/architecture.md, "The DRAM tier"); bench/setup_bench.py
        # measures them alone.
        out["dram_fault_pin_seconds"] = [caps.dram_fault_seconds, caps.dram_pin_seconds]
        # How much of it the kernel put on huge pages (madvise asks; it may not grant them),
        # against the arena's size: the update's rate depends on it (TLB misses).
        out["arena_huge_pages_gb"] = [huge_page_bytes() / 1e9, caps.tier_budget_bytes[1] / 1e9]
        out["plan"] = "%d slots of %.0f MB, %d of %d blocks resident" % (
            info.slots, info.slot_bytes / 1e6, out["resident_blocks"], config.num_hidden_layers)

        def step(ids):
            mark("start")
            # --accum: the batch in that many micro-batches, each backward pass accumulating
            # (the mark "forward" after the first one's forward pass); the step's loss is
            # their mean, the whole batch's.
            total = 0.0
            for i, part in enumerate(ids.chunk(accumulation())):
                loss = model(part, labels=part).loss / accumulation()
                if i == 0:
                    mark("forward")
                loss.backward()
                total = total + loss.detach()
            mark("backward")
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                mark("clip")
            opt.step()
            opt.zero_grad()
            mark("step")
            return total
    else:
        if mode in ("resident", "resident-nockpt"):
            # All in HBM, torch's fused AdamW; "resident" recomputes each block in the backward
            # (checkpointing, as strata.torch's blocks do), "resident-nockpt" keeps every
            # activation: the fastest a model that fits can train.
            model = build_model(config, impl, device)
            if mode == "resident":
                checkpoint_blocks(model, impl)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        elif mode == "fsdp2":
            import torch.distributed as dist
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29517")
            dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
            torch.cuda.set_device(0)
            model = build_model(config, impl, "meta")
            policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=True),
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                         reduce_dtype=torch.float32))
            checkpoint_blocks(model, impl)
            for block in model.model.layers:
                fully_shard(block, **policy)
            fully_shard(model, **policy)
            if impl == "hf":
                materialize(model, "cpu")
            else:
                model.to_empty(device="cpu")
                model.apply(model._init_weights)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        elif mode in ("deepspeed-nvme", "deepspeed-cpu"):
            # The peer of issue 14: DeepSpeed ZeRO-3 on one GPU, its parameters and optimizer
            # state offloaded to NVMe (ZeRO-Infinity: deepspeed-nvme, in a directory beside
            # --nvme) or to pinned DRAM (deepspeed-cpu).
            engine = setup_deepspeed(config, mode, batch, clip, nvme,
                                     int(os.environ.get("DS_PARAM_BUFFERS", "16")), impl)
            model = engine.module
            step = engine_step(engine)
        else:
            raise ValueError(mode)
        if opt is not None:
            step = plain_step(model, opt, clip, autocast=mode.startswith("resident"))
    out["setup_seconds"] = time.perf_counter() - t_setup
    try:
        return measure(out, mode, preset, config, model, step, data, device, cuda, marks, steps,
                        warmup, batch, seq, trace, nvme, opt)
    finally:
        if mode == "deepspeed-nvme":
            # Its swap files (tens of GB) would otherwise crowd the next mode off the disk,
            # a failed run's too.
            import shutil
            shutil.rmtree(nvme + ".deepspeed", ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="1b,3b,7b",
                   help="comma-separated presets (%s) or specs like h4096-l40-i14336-kv8-v32000; "
                        "8b is Llama 3.1 8B's shape (vocabulary 128256), tiny a CPU check"
                        % ", ".join(__import__("llama_zoo").PRESETS))
    p.add_argument("--impl", choices=("hf", "zoo"), default="hf",
                   help="the model: Hugging Face's LlamaForCausalLM (hf, sdpa; the default) or "
                        "the package's own Llama of bench/llama_zoo (zoo)")
    p.add_argument("--modes", default="strata,resident,fsdp2",
                   help="comma-separated: strata, strata-separate (strata with whole fp32 "
                        "masters, not split ones), strata-device-grads (the streamed blocks' "
                        "grads in HBM, not DRAM), resident (all in HBM, checkpointed blocks), "
                        "resident-nockpt (all in HBM, no recompute), fsdp2, deepspeed-nvme "
                        "(ZeRO-3 offloading parameters and optimizer state to NVMe beside --nvme: "
                        "ZeRO-Infinity), deepspeed-cpu (ZeRO-3 offloading to DRAM), megatrain "
                        "(as --peer megatrain); empty: only the --peer runs")
    p.add_argument("--peer", default="", choices=("", "megatrain"),
                   help="megatrain: MegaTrain's training of the same model, batch, steps and "
                        "clip, after the --modes (needs --megatrain-dir)")
    p.add_argument("--megatrain-dir", default=None,
                   help="MegaTrain's source tree (its infinity package; patched for sdpa: "
                        "docs/benchmarks.md)")
    p.add_argument("--dry-run", action="store_true",
                   help="megatrain: check its import, configuration and sdpa mask on the CPU "
                        "(no training; MegaTrain needs CUDA to train)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cpu: a check of the script on a machine without a GPU (strata on its "
                        "host backend; default: cuda, or $STRATA_BENCH_DEVICE)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip_grad_norm_(model.parameters(), CLIP) before every step (0: off)")
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="strata: blocks kept in HBM (default: strata.torch.offload's choice)")
    p.add_argument("--nvme", default=None,
                   help="strata: an NVMe tier file for optimizer state and weights; "
                        "deepspeed-nvme: its files go to the directory PATH.deepspeed")
    p.add_argument("--host-budget", type=float, default=None,
                   help="strata: GiB of host memory (st.offload(host_budget=); with --nvme: the "
                        "rest of the state spills)")
    p.add_argument("--weights", default=None,
                   help="strata: load the model from this safetensors checkpoint "
                        "(st.offload(weights=)) instead of initializing it")
    p.add_argument("--trace", default=None,
                   help="strata: a Chrome trace of the measured steps, written to TRACE-MODEL.json")
    p.add_argument("--profile", default=None,
                   help="every mode: torch.profiler over the last measured step (host ops and "
                        "kernels), a Chrome trace written to PROFILE-MODEL-MODE.json.gz")
    p.add_argument("--loss", choices=("torch", "liger"), default=None,
                   help="--impl zoo, every mode: the model's loss as Hugging Face computes it "
                        "(torch: the "
                        "logits whole, in fp32; the default) or Liger's fused linear "
                        "cross-entropy (liger-kernel: a chunk of tokens at a time)")
    p.add_argument("--optimizer-threads", type=int, default=None,
                   help="strata: the CPU optimizer's threads (default: the GPU's node's CPUs "
                        "less one)")
    p.add_argument("--paged-state", default=None,
                   help="strata: the resident parameters' optimizer state paged to host memory "
                        "between steps (strata.torch.paging): 'auto', 'all', N (the first N "
                        "resident blocks'), 0 (none); default: strata.torch.AdamW's ('auto')")
    p.add_argument("--accum", type=int, default=1,
                   help="every mode but deepspeed's: each step's batch in this many "
                        "micro-batches, their grads accumulated (gradient accumulation)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--jsonl", default=None,
                   help="append each configuration's result here as one JSON line, as soon as "
                        "it is measured")
    p.add_argument("--logs", default=None,
                   help="a directory: each configuration's stderr (its progress, its library's "
                        "log, its error) written to MODEL-MODE.log there")
    p.add_argument("--host-memory", type=float, default=0,
                   help="GB of MemAvailable to make sure of first, touching memory where the "
                        "VM grows its RAM on demand (host_memory.grow_host_memory)")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="seconds one configuration may run (default: no limit)")
    p.add_argument("--one", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device:  # read by run_one, in this process or the one per configuration
        os.environ["STRATA_BENCH_DEVICE"] = args.device
    modes = [m for m in args.modes.split(",") if m] + ([args.peer] if args.peer else [])
    if not modes:
        p.error("no configuration: give --modes or --peer")
    if "megatrain" in modes:
        if not args.megatrain_dir:
            p.error("megatrain: give --megatrain-dir DIR (MegaTrain's source tree)")
        if args.accum > 1:
            p.error("megatrain: --accum 1 only (MegaTrain's recipe trains one batch a step; its "
                    "gradient_accumulation_steps sums the grads of whole steps)")
        if args.impl != "hf":
            p.error("megatrain: --impl hf (it trains Hugging Face models)")
    if args.loss and args.impl != "zoo":
        p.error("--loss: --impl zoo only (the Hugging Face model's loss is its own, or "
                "strata.torch's over chunks of tokens)")
    if args.loss:  # read by run_one, in this process or the one per configuration
        os.environ["STRATA_BENCH_LOSS"] = args.loss
    if args.profile is not None:  # likewise
        os.environ["STRATA_BENCH_PROFILE"] = os.path.abspath(args.profile)
    if args.paged_state is not None:  # likewise
        os.environ["STRATA_BENCH_PAGED_STATE"] = args.paged_state
    if args.optimizer_threads is not None:  # likewise
        os.environ["STRATA_BENCH_OPTIMIZER_THREADS"] = str(args.optimizer_threads)
    if args.accum < 1 or args.batch % args.accum:
        p.error("--accum %d must be at least 1 and divide --batch %d" % (args.accum, args.batch))
    if args.accum > 1 and any(m.startswith("deepspeed") for m in modes):
        p.error("--accum: not for the deepspeed modes (their config sets the accumulation)")
    os.environ["STRATA_BENCH_ACCUM"] = str(args.accum)  # likewise
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.batch, args.seq, args.steps,
                                 args.warmup, args.clip, args.resident_blocks, args.nvme,
                                 args.host_budget, args.trace, args.weights, args.impl,
                                 args.megatrain_dir, args.dry_run)), flush=True)
        return
    if args.host_memory:
        from host_memory import mem_available
        seconds = grow_host_memory(int(args.host_memory * 1e9))
        print("host memory: %.0f GB available (%.0f s to grow it; %.0f GB asked for)"
              % (mem_available() / 1e9, seconds, args.host_memory), flush=True)
    results = []
    for preset in args.models.split(","):
        for mode in modes:
            cmd = [sys.executable, __file__, "--one", mode, preset, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--clip", str(args.clip), "--impl", args.impl, "--accum", str(args.accum)]
            if mode == "megatrain":
                cmd += ["--megatrain-dir", args.megatrain_dir] + \
                    (["--dry-run"] if args.dry_run else [])
            if args.resident_blocks is not None:
                cmd += ["--resident-blocks", str(args.resident_blocks)]
            if args.nvme:
                cmd += ["--nvme", args.nvme]
            if args.host_budget:
                cmd += ["--host-budget", str(args.host_budget)]
            if args.weights and mode == "strata":
                cmd += ["--weights", args.weights]
            if args.trace:
                cmd += ["--trace", "%s-%s.json" % (args.trace, preset)]
            print("%s%s %s: %s" % (PROGRESS, preset, mode, " ".join(cmd[2:])), file=sys.stderr,
                  flush=True)
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      timeout=args.run_timeout)
                stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                def text(b):
                    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                stdout, stderr, code = text(e.stdout), text(e.stderr) + \
                    "\ntimed out after %.0f s" % args.run_timeout, None
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
                pathlib.Path(args.logs, "%s-%s.log" % (preset, mode)).write_text(
                    "$ %s\n%s" % (" ".join(cmd), stderr))
            lines = [l for l in stdout.splitlines() if l.startswith("{")]
            if code != 0 or not lines:
                err = ([l for l in stderr.strip().splitlines()
                        if not l.startswith(PROGRESS)] or ["exit %d" % code])[-1]
                results.append({"mode": mode, "model": preset, "impl": args.impl,
                                "batch": args.batch, "seq": args.seq, "accum": args.accum,
                                "error": err[:300]})
            else:
                results.append(json.loads(lines[-1]))
            r = results[-1]
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(r) + "\n")
            if "error" in r:
                print("%-4s %-15s failed: %s" % (preset, mode, r["error"]), flush=True)
            elif r.get("dry_run"):
                print("%-4s %-15s dry run: %s" % (preset, mode, r["dry_run"]), flush=True)
            else:
                print("%-4s %-15s %8.0f tokens/s  %6.1f TFLOPS (6PT/t)  %6.1f (done)  step %.2f s  "
                      "host %.1f GB  device %.1f GB (reserved %.1f, %d retries)  setup %.0f s  %s"
                      % (preset, mode, r["tokens_per_second"], r["tflops_6pt"], r["tflops_done"],
                         r["step_seconds"], r["peak_host_gb"], r["peak_device_gb"],
                         r.get("peak_reserved_device_gb", 0.0), r.get("alloc_retries", 0),
                         r["setup_seconds"], r.get("plan", "")), flush=True)
                if "dram_bytes_per_streamed_param" in r:
                    print("     DRAM arena %.1f GB used (%.1f GB of it pinned, %d fallbacks): "
                          "%.2f bytes per streamed parameter"
                          % (r["dram_used_gb"], r["dram_pinned_gb"][0], r["dram_fallbacks"],
                             r["dram_bytes_per_streamed_param"]), flush=True)
                if r.get("setup_phases"):
                    print("     setup (s): %s" % "  ".join(
                        "%s %.1f" % kv for kv in r["setup_phases"].items()) +
                        "  (runtime: fault-in %.1f, pin %.1f)" % tuple(
                            r["dram_fault_pin_seconds"]) +
                        ("; huge pages %.1f of %.1f GB" % tuple(r["arena_huge_pages_gb"])
                         if "arena_huge_pages_gb" in r else "") +
                        ("; update rate at start %.2f G/s" %
                         (r["update_rate_measured_at_start"] / 1e9)
                         if "update_rate_measured_at_start" in r else "") +
                        ("; model on meta %.1f, offload %.1f, optimizer %.1f" % (
                            r["setup_split"]["build"], r["setup_split"]["offload"],
                            r["setup_split"]["optimizer"]) if "setup_split" in r else ""),
                        flush=True)
                if r.get("phases"):
                    print("     phases (host s / device s since the step's start): %s" % "  ".join(
                        "%s %.3f/%.3f" % (k, h, d) for k, (h, d) in r["phases"].items()),
                        flush=True)
                print("     %d x %d tokens%s, losses %s" % (
                    r["batch"], r["seq"], " as %d micro-batches of %d" % (
                        r["accum"], r["batch"] // r["accum"]) if r["accum"] > 1 else "",
                    " ".join("%.4f" % x for x in r["losses"])), flush=True)
                if "placement" in r:
                    print("     %s" % r["placement"], flush=True)
                if "predicted_step_seconds" in r:
                    print("     predicted step %.2f s = %.3f of the measured (block forward "
                          "%.3f s, backward %.3f s, rest %.3f s, measured apart)\n     %s"
                          % (r["predicted_step_seconds"], r["predicted_over_measured"],
                             *r["probe_seconds"], r["prediction"].replace("\n", "\n     ")),
                          flush=True)
                if "nvme_read_gb_per_step" in r:
                    print("     NVMe per step: read %.1f GB, write %.1f GB; updates waited %.2f s "
                          "for state; losses %s"
                          % (r["nvme_read_gb_per_step"], r["nvme_write_gb_per_step"],
                             r["stage_wait_seconds_per_step"],
                             ", ".join("%.3f" % x for x in r["losses"])), flush=True)
    # Ratios against the peers, per model (also in the JSON, so a regression shows there).
    ratios = []
    for preset in args.models.split(","):
        by = {r["mode"]: r for r in results if r["model"] == preset and "tokens_per_second" in r}
        if "strata" in by:
            for peer in ("resident", "resident-nockpt", "fsdp2", "deepspeed-nvme",
                         "deepspeed-cpu", "megatrain"):
                if peer in by:
                    ratio = by["strata"]["tokens_per_second"] / by[peer]["tokens_per_second"]
                    ratios.append({"model": preset, "ratio": "strata/" + peer,
                                   "tokens_per_second": ratio})
                    print("%-4s strata / %-15s = %.3f (tokens/s)" % (preset, peer, ratio))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios},
                                                      indent=1))


if __name__ == "__main__":
    main()
