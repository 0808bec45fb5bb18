#!/usr/bin/env python3
"""Strata's main job: train a Llama-style model through Strata's streaming runtime.

The decoder blocks live in Strata's pinned host memory (or NVMe) and stream through the GPU
(or, without one, through the simulated `host` device on the CPU); the CPU optimizer keeps fp32
masters and updates each block as its grads land. Trains on a bundled text (bytes as tokens)
or synthetic tokens; nothing is downloaded. Prints a progress line per step (loss, tokens/s)
and the tier traffic at the end.

    python examples/train.py                          # tiny model, bundled text, 30 steps
    python examples/train.py --model 1b --steps 20 --batch 8 --seq 2048 --dtype bfloat16
    python examples/train.py --model path/to/config.json   # a Hugging Face config (transformers)
    python examples/train.py --model path/to/config.json --weights path/to/checkpoint_dir
                                                      # fine-tune its safetensors weights
"""
import argparse
import contextlib
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))  # a checkout without pip install
sys.path.insert(0, str(ROOT / "bench"))  # llama_zoo, the Llama-style model of the examples

import strata  # noqa: E402
import strata.torch as st  # noqa: E402
from llama_zoo.torch_llama import (LlamaConfig, LlamaForCausalLM, PRESETS,  # noqa: E402
                                   flops_per_token)


def build_model(spec):
    if spec in PRESETS:
        return LlamaForCausalLM(PRESETS[spec]), PRESETS[spec]
    path = pathlib.Path(spec)
    if not path.exists():
        sys.exit("train.py: --model is a preset (%s) or a config file; %s does not exist"
                 % (", ".join(PRESETS), spec))
    fields = json.loads(path.read_text())
    try:
        import transformers
        config = transformers.AutoConfig.for_model(**fields)
        model = transformers.AutoModelForCausalLM.from_config(config)
        ours = LlamaConfig(**{k: fields[k] for k in LlamaConfig.__dataclass_fields__ if k in fields})
        return model, ours
    except ImportError:
        ours = LlamaConfig(**{k: fields[k] for k in LlamaConfig.__dataclass_fields__ if k in fields})
        return LlamaForCausalLM(ours), ours


def batches(config, batch, seq, synthetic, seed):
    g = torch.Generator().manual_seed(seed)
    if synthetic:
        while True:
            yield torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    data = torch.tensor(list((ROOT / "examples" / "data" / "corpus.txt").read_bytes()))
    data = data % config.vocab_size
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s:s + seq] for s in starts])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="preset (%s) or an HF config.json" % ", ".join(PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--synthetic", action="store_true", help="random tokens instead of the text")
    p.add_argument("--gpu-budget", type=float, default=None, help="GiB of HBM for Strata")
    p.add_argument("--host-budget", type=float, default=None, help="GiB of pinned DRAM")
    p.add_argument("--nvme", action="append", default=None,
                   help="NVMe tier file (repeatable, striped): optimizer state that does not fit "
                        "in --host-budget goes there")
    p.add_argument("--nvme-budget", type=float, default=None,
                   help="GiB of the NVMe tier (default: what the spilled state needs)")
    p.add_argument("--grads", default="host", choices=["host", "device"],
                   help="where the streamed blocks' grads live between backward and step: "
                        "'device' saves 2 bytes per parameter of DRAM for as many of HBM")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", default=None,
                   help="start from a safetensors checkpoint of this model (a file, or a Hugging "
                        "Face directory): the model is built on the meta device and the file's "
                        "values go straight into Strata")
    args = p.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(args.seed)
    with torch.device("meta") if args.weights else contextlib.nullcontext():
        model, config = build_model(args.model)
    params = sum(p.numel() for p in model.parameters())
    gib = 1 << 30
    model = st.offload(model, device=device, dtype=dtype,
                       gpu_budget=int(args.gpu_budget * gib) if args.gpu_budget else None,
                       host_budget=int(args.host_budget * gib) if args.host_budget else None,
                       nvme=args.nvme,
                       nvme_budget=int(args.nvme_budget * gib) if args.nvme_budget else None,
                       weights=args.weights, grads=args.grads)
    session = model.strata
    opt = st.AdamW(model, lr=args.lr, weight_decay=0.1)
    caps = session.runtime.capabilities()
    info = session.executor.plan_info()
    print("strata %s | %s backend on %s | model %s: %.1fM parameters, %d streamed blocks, %s"
          % (strata.version(), session.runtime.backend, caps.device_name.decode(), args.model,
             params / 1e6, len(session.blocks), str(dtype).replace("torch.", "")))
    print("plan: %d HBM slots of %.1f MB, prefetch depth %d; optimizer: %d threads, %s"
          % (info.slots, info.slot_bytes / 1e6, info.forward_prefetch_depth,
             session.optimizer.stats()["threads"], session.optimizer.stats()["isa"]))
    print("placement: " + session.placement())
    if args.trace:
        session.runtime.trace_start()
    data = batches(config, args.batch, args.seq, args.synthetic, args.seed)
    six_p, _ = flops_per_token(config, args.seq)
    tokens = args.batch * args.seq
    start = time.perf_counter()
    first_loss = None
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ids = next(data).to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()  # waits for the step's compute
        first_loss = value if first_loss is None else first_loss
        dt = time.perf_counter() - t0
        bar = "#" * (20 * step // args.steps)
        line = "step %4d/%d [%-20s] loss %.4f  %8.0f tokens/s" % (
            step, args.steps, bar, value, tokens / dt)
        if device.type == "cuda":
            line += "  %6.1f TFLOPS (6PT/t)" % (six_p * tokens / dt / 1e12)
        # A live bar on a terminal; a line every 10 steps in a log.
        if sys.stdout.isatty():
            print("\r" + line, end="\n" if step == args.steps else "", flush=True)
        elif step % 10 == 0 or step in (1, args.steps):
            print(line, flush=True)
    opt.synchronize()
    elapsed = time.perf_counter() - start
    print("loss %.4f -> %.4f in %d steps, %.1f s, %.0f tokens/s overall"
          % (first_loss, value, args.steps, elapsed, tokens * args.steps / elapsed))
    if args.trace:
        session.runtime.trace_flush(args.trace)
        print("trace written to %s (tools/strata-prof %s)" % (args.trace, args.trace))
    print("%-11s %14s %10s %12s" % ("link", "bytes", "transfers", "GB/s (busy)"))
    for name, s in session.runtime.link_stats().items():
        busy = s["busy_seconds"]
        print("%-11s %14d %10d %12.2f" % (name, s["bytes"], s["transfers"],
                                          s["bytes"] / busy / 1e9 if busy > 0 else 0.0))
    o = session.optimizer.stats()
    dram = session.runtime.tier_usage("dram")
    print("optimizer: %d updates, %.2f s of update time; DRAM %.1f of %.1f MB used"
          % (o["step"], o["update_seconds"], dram["used"] / 1e6, dram["budget"] / 1e6))
    session.close()


if __name__ == "__main__":
    main()
