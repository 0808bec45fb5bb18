#!/usr/bin/env python3
"""Training throughput of a mixture-of-experts model through Strata (issue 53 item 4), next to
MegaTrain and the same model fully resident where it fits, with the same tokens per step, each
configuration in its own process (so peak memory is its own).

The model is Hugging Face's Qwen3MoeForCausalLM with Qwen3-30B-A3B's layer shape (hidden 2048,
32 query and 4 KV heads of 128, 128 experts of FFN 768 with 8 active a token, vocabulary
151936, untied head) and --layers of them (10: 6.85B parameters, 0.88B active), trained as
the README shows: built on the meta device from its config, st.offload(model,
dtype=torch.bfloat16), st.AdamW(model.parameters()), the loss from model(ids, labels=ids) with
the router's auxiliary loss on (output_router_logits=True, router_aux_loss_coef
--router-loss, Qwen3-30B-A3B's 0.001; 0 turns it off), clip_grad_norm_(model.parameters(),
--clip). The experts run through Hugging Face's experts_implementation: its default
(grouped_mm, torch's grouped matrix product where the GPU has one) unless
--experts-implementation names another. Weights: bench_models.fast_init's seeded values (the
experts' 3-D weights too), AdamW lr 1e-4, weight decay 0.1, random tokens (two seeded
batches in turn).

Modes: strata; resident (every weight on the GPU in fp32 under bf16 autocast, torch's AdamW
on the GPU, each block checkpointed: the model without offloading, where it fits); megatrain
(--peer megatrain --megatrain-dir DIR, MegaTrain's source tree, driven through its Python API
as bench/train_bench.py drives it: bench/megatrain_peer.py).

Reported per configuration: the median step time after warm-up, every step's seconds and
loss, tokens/s, TFLOPS on the active parameters (6 P_active T / t, P_active = what a token
computes with: attention, router and its 8 experts per block, and the head; the embedding is a
lookup) and, counted separately, causal attention's (3 x its forward: 2 x seq x heads x
head_dim per token and layer), peak device and host memory.

    python bench/moe_bench.py --layers 10 --batch 32 --seq 1024 --clip 1.0 \
        --modes strata --peer megatrain --megatrain-dir .stage/megatrain/src
    python bench/moe_bench.py --layers 3 --batch 32 --seq 1024 --clip 1.0 --modes strata,resident
    python bench/moe_bench.py --dry-run    # the CPU, a tiny config: checks the script

--dry-run runs every mode on the CPU (MegaTrain's training needs CUDA: there the peer runs
only with a stand-in for its package, as tests/python/tools/test_moe_bench.py does).
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))

from host_memory import peak_host_bytes  # noqa: E402 (bench/ is on sys.path when run)

# Qwen3-30B-A3B's layer shape (its config.json); the layer count is the bench's.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)
# --dry-run's shape: the same structure, small enough for the CPU in seconds.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, rope_theta=1e6,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
LR, WEIGHT_DECAY = 1e-4, 0.1


def moe_config(layers, router_loss, tiny=False, experts_implementation=None):
    """Hugging Face's Qwen3MoeConfig of this run (sdpa attention, no KV cache)."""
    from transformers import Qwen3MoeConfig
    shape = TINY if tiny else QWEN3_30B_A3B
    config = Qwen3MoeConfig(num_hidden_layers=layers, output_router_logits=router_loss > 0,
                            router_aux_loss_coef=router_loss, use_cache=False, **shape)
    config._attn_implementation = "sdpa"
    if experts_implementation:
        config._experts_implementation = experts_implementation
    return config


def counts(config):
    """(every parameter, the active ones a token computes with, attention's forward FLOPs per
    token at seq 1 (times seq: causal QK^T and AV over half the positions, both layers' worth))
    of `config`: what the TFLOPS figures count."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attention = h * q * 2 + h * kv * 2 + 2 * config.head_dim  # q, o, k, v; q and k norms
    expert = 3 * h * config.moe_intermediate_size  # gate, up, down
    router = h * config.num_experts
    norms = 2 * h
    block = attention + router + norms + config.num_experts * expert
    active_block = attention + router + norms + config.num_experts_per_tok * expert
    embedding = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else embedding
    total = layers * block + embedding + head + h
    active = layers * active_block + embedding + h  # the head's product; the lookup is free
    return total, active, 2 * q * layers


def moe_init(module):
    """bench_models.fast_init, extended to what it leaves alone (the `weight` of a linear layer,
    an embedding or a norm): the experts' 3-D gate_up_proj and down_proj and the router's
    weight (a module of its own, not an nn.Linear) get its tiled values too. Left to
    to_empty's uninitialized memory, they made the loss NaN."""
    import torch
    from torch import nn
    from bench_models import fast_init, fill_tiled
    fast_init(module)
    if isinstance(module, (nn.Linear, nn.Embedding)) or "norm" in type(module).__name__.lower():
        return
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            if not p.is_meta:
                fill_tiled(p) if p.dim() >= 2 else p.zero_()


def build_model(config, device, dtype=None):
    """The model on `device` (meta: nothing allocated, st.offload initializes each block as it
    places it, with model._init_weights), moe_init's values elsewhere."""
    import torch
    from transformers import Qwen3MoeForCausalLM
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM._from_config(config, **({"dtype": dtype} if dtype else {}))
    model._init_weights = moe_init
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.apply(moe_init)
        rotary = model.model.rotary_emb  # its inverse frequencies: a buffer to_empty dropped
        model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    return model.train()


def _loss_step(model, opt, clip, autocast=None):
    """One step of the ordinary loop; `autocast` a dtype or None."""
    import contextlib
    import torch

    def step(ids):
        device_type = next(model.parameters()).device.type
        with torch.autocast(device_type, dtype=autocast) if autocast else \
                contextlib.nullcontext():
            loss = model(ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def setup(mode, config, device, args):
    """(step(ids) -> loss, what the run reports about the mode, close())."""
    import torch
    if mode == "strata":
        import strata.torch as st
        model = st.offload(build_model(config, "meta"), device=device, dtype=torch.bfloat16,
                           resident_blocks=args.resident_blocks)
        opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        info = {"resident_blocks": len(model.strata.resident_blocks),
                "experts_implementation": model.config._experts_implementation}

        def close():
            # The activation keeper's measurement of the streamed blocks (on fake tensors):
            # how many gave a figure (a block it cannot measure stays checkpointed).
            measured = model.strata.activations.measures.streamed_measured
            info["keeper_measured_streamed_blocks"] = [
                sum(v is not None for v in measured.values()), len(model.strata.blocks)]
            model.strata.close()
        return _loss_step(model, opt, args.clip), info, close
    if mode == "resident":
        model = build_model(config, device)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                fused=device.type == "cuda")
        info = {"experts_implementation": model.config._experts_implementation,
                "plan": "every weight, grad and AdamW state on the device (fp32), bf16 "
                        "autocast, each block checkpointed"}
        return _loss_step(model, opt, args.clip, torch.bfloat16), info, lambda: None
    if mode == "megatrain":
        import megatrain_peer
        megatrain_peer.load(args.megatrain_dir)  # a wrong tree refused before the build
        hf = build_model(config, "cpu", dtype=torch.bfloat16)
        peer = megatrain_peer.setup(args.megatrain_dir, hf, args.batch, args.seq, args.clip)
        return peer.step, dict(peer.info), peer.close
    raise SystemExit("mode %r: not strata, resident or megatrain" % mode)


def run_one(mode, args):
    """One configuration measured: a dict for the JSON line."""
    import torch
    device = torch.device("cpu" if args.dry_run else "cuda")
    cuda = device.type == "cuda"
    config = moe_config(args.layers, args.router_loss, args.dry_run, args.experts_implementation)
    total, active, attention_per_seq = counts(config)
    tokens = args.batch * args.seq
    out = {"mode": mode, "model": "qwen3-moe-%dL%s" % (args.layers, "-tiny" * args.dry_run),
           "params": total, "active_params": active, "batch": args.batch, "seq": args.seq,
           "tokens_per_step": tokens, "clip": args.clip, "router_loss": args.router_loss,
           "device": str(device),
           "flops_count": "6*P_active*T/t (P_active: attention, router and the active experts "
                          "of each block, and the head); attention 3 x 2*seq*heads*head_dim "
                          "per token and layer, apart"}
    if cuda:
        out["device_name"] = torch.cuda.get_device_name()
        from strata.torch._allocator import prefer_expandable_segments
        prefer_expandable_segments(device)  # every mode on the allocator offload sets up
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
            for _ in range(2)]
    started = time.perf_counter()
    step, info, close = setup(mode, config, device, args)
    out["setup_seconds"] = time.perf_counter() - started
    seconds, losses = [], []
    try:
        for i in range(args.warmup + args.steps):
            ids = data[i % 2].to(device) if mode != "megatrain" else data[i % 2]
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(ids)
            losses.append(float(loss))  # waits for the step's device work
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
    finally:
        close()
        out.update(info)  # what the mode reports, some of it at its close
    median = statistics.median(seconds[args.warmup:] or seconds)
    out.update({
        "step_seconds": seconds, "losses": losses, "median_step_seconds": median,
        "tokens_per_second": tokens / median,
        "tflops_6pt_active": 6 * active * tokens / median / 1e12,
        "tflops_attention": 3 * attention_per_seq * args.seq * tokens / median / 1e12,
        "peak_host_bytes": peak_host_bytes()})
    out["tflops_active_with_attention"] = out["tflops_6pt_active"] + out["tflops_attention"]
    if cuda:
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


def summary(result):
    if "error" in result:
        return "%s: failed: %s" % (result["mode"], result["error"].strip().splitlines()[-1:])
    return ("%s %s, %d x %d: %.3f s a step, %.0f tokens/s, %.1f TFLOPS active (%.1f with "
            "attention)" % (result["model"], result["mode"], result["batch"], result["seq"],
                            result["median_step_seconds"], result["tokens_per_second"],
                            result["tflops_6pt_active"], result["tflops_active_with_attention"]))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10,
                   help="decoder layers of Qwen3-30B-A3B's shape (10: 6.85B parameters)")
    p.add_argument("--modes", default="strata", help="comma-separated: strata, resident")
    p.add_argument("--peer", default="", choices=("", "megatrain"),
                   help="megatrain: MegaTrain on the same model after the --modes")
    p.add_argument("--megatrain-dir", default=None, help="MegaTrain's source tree")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--router-loss", type=float, default=0.001,
                   help="router_aux_loss_coef (0: output_router_logits off)")
    p.add_argument("--experts-implementation", default=None,
                   help="Hugging Face's experts_implementation (default: the model's, "
                        "grouped_mm)")
    p.add_argument("--resident-blocks", type=int, default=None, help="strata: offload's")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU, a tiny config of the same structure (2 layers unless "
                        "--layers says otherwise), 1 warm-up and 2 steps")
    p.add_argument("--jsonl", default=None, help="append each result here as one JSON line")
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per configuration")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m] + ([args.peer] if args.peer else [])
    for m in modes:
        if m not in ("strata", "resident", "megatrain"):
            p.error("--modes: %r is not strata or resident" % m)
    if "megatrain" in modes and not args.megatrain_dir:
        p.error("--peer megatrain: give --megatrain-dir DIR (MegaTrain's source tree)")
    if args.dry_run and "--layers" not in (argv if argv is not None else sys.argv):
        args.layers = 2
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    return args, modes


def forwarded(args):
    """The flags a configuration's own process gets."""
    flags = ["--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--clip", str(args.clip),
             "--router-loss", str(args.router_loss)]
    for name in ("megatrain_dir", "experts_implementation", "resident_blocks"):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags + (["--dry-run"] if args.dry_run else [])


def main(argv=None):
    args, modes = parse(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return 0
    failed = 0
    for mode in modes:
        cmd = [sys.executable, __file__, "--one", mode] + forwarded(args)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else \
                {"mode": mode, "error": proc.stderr[-4000:] or "exit %d" % proc.returncode}
        except subprocess.TimeoutExpired:
            result = {"mode": mode, "error": "timed out after %.0f s" % args.run_timeout}
        failed += "error" in result
        print(summary(result), flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
