"""MegaTrain (github.com/DLYuanGod/MegaTrain) as a peer of bench/train_bench.py: its training of a
Hugging Face model driven through its Python API, step for step as its examples/sft/train.py
runs it, so that train_bench's loop times it as it times every other mode.

MegaTrain is not part of this repository: --megatrain-dir names its source tree (the directory
holding its `infinity` package). Its decoder layers are called directly with the batch's 2-D
padding mask, which only flash-attn accepts; with sdpa (no flash-attn here) the tree must carry
the patch docs/benchmarks.md describes (bench/megatrain_sdpa_mask.patch, which
bench/stage_gpu.sh applies: CPUMasterModel._layer_attention_mask, no mask when nothing is
padded, so sdpa runs causal; the 4-D mask otherwise). setup() refuses a tree without it.

Its step: forward_and_backward(input_ids, attention_mask, labels) (its loss: the mean over the
shifted labels, 128 positions of logits at a time), clip_grad_norm_(get_parameters(), clip),
the optimizer's step (DeepSpeedCPUAdam, as its recipes choose, where DeepSpeed is installed;
else torch's AdamW, its own fallback) on its CPU parameters (bf16, as its train.py loads them),
_sync_params_to_gpu(), zero_grad() of the model and the optimizer. Its Llama-3-8B recipe
(examples/sft/configs/llama3_8b.yaml): 148 x 1024 tokens a step, one batch, checkpoint_interval
4, num_grad_slabs 12, max_grad_norm 1.0."""
import os
import sys
import types

# examples/sft/configs/llama3_8b.yaml's memory settings.
CHECKPOINT_INTERVAL = 4
NUM_GRAD_SLABS = 12


def load(megatrain_dir):
    """MegaTrain's package from megatrain_dir; refused (SystemExit) if it is not there or lacks
    the sdpa mask patch."""
    path = os.path.abspath(megatrain_dir)
    if not os.path.isdir(os.path.join(path, "infinity")):
        raise SystemExit("--megatrain-dir %s: no infinity/ package there (MegaTrain's source "
                         "tree is expected)" % megatrain_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    import infinity
    from infinity.model.cpu_master import CPUMasterModel
    if not hasattr(CPUMasterModel, "_layer_attention_mask"):
        raise SystemExit("MegaTrain at %s lacks the sdpa attention-mask patch "
                         "(CPUMasterModel._layer_attention_mask; docs/benchmarks.md): its layers "
                         "would get the 2-D padding mask, which only flash-attn accepts"
                         % megatrain_dir)
    return infinity


def _commit(megatrain_dir):
    """The MegaTrain commit the tree was copied from (a MEGATRAIN_COMMIT file beside infinity/,
    written when it was staged), or None."""
    try:
        with open(os.path.join(megatrain_dir, "MEGATRAIN_COMMIT")) as f:
            return f.read().strip()
    except OSError:
        return None


def _config(infinity, batch, seq, clip, devices=None):
    """Its configuration for this run: `batch` rows a step over all of `devices` (CUDA device
    numbers; more than one: its data-parallel mode, one worker process a device, each on
    batch / len(devices) rows), examples/sft/configs/llama3_8b.yaml's memory settings."""
    import torch
    return infinity.CPUMasterConfig(
        model_name="train_bench (built from its config, fast_init)",
        dataset_path="synthetic (train_bench's random tokens)",  # it requires one; unused
        batch_size=batch, max_seq_len=seq, gradient_accumulation_steps=1,
        learning_rate=1e-4, weight_decay=0.1, max_grad_norm=clip,  # train_bench's AdamW
        attn_implementation="sdpa", trust_remote_code=False, dtype=torch.bfloat16, device=0,
        checkpoint_interval=CHECKPOINT_INTERVAL, num_grad_slabs=NUM_GRAD_SLABS, seed=0,
        log_interval=1, **({"devices": list(devices)} if devices else {}))


def _optimizer(params, config):
    """DeepSpeedCPUAdam where DeepSpeed is installed and builds it (its recipes' choice,
    "deepspeed_adam"), else torch's AdamW (its train.py's fallback): (optimizer, name)."""
    import torch
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, lr=config.learning_rate,
                                betas=(config.beta1, config.beta2), eps=config.eps,
                                weight_decay=config.weight_decay,
                                adamw_mode=True), "DeepSpeedCPUAdam"
    except Exception as e:  # not installed, or its op does not build here
        reason = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:120] if str(e) else "")
    return torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.beta1, config.beta2),
                             eps=config.eps, weight_decay=config.weight_decay), \
        "torch.optim.AdamW on the CPU (DeepSpeedCPUAdam unavailable: %s)" % reason


def setup(megatrain_dir, hf_model, batch, seq, clip, devices=None):
    """MegaTrain's CPUMasterModel of hf_model (a Hugging Face causal LM on the CPU, bf16) and its
    optimizer: a namespace with step(ids) -> loss (one optimizer step on the batch ids, labels
    the same ids, nothing padded), info (what the run reports), report() (its own forward and
    backward timings of the measured steps), workers() (the process ids of its data-parallel
    workers) and close(). With several `devices`, its data-parallel mode (examples/sft/train.py
    --devices 0,1,...): it spawns one worker process a device, hands each its contiguous
    batch / len(devices) rows, the workers add their grads into shared-memory tensors, and this
    process clips and steps the optimizer over all of them."""
    import logging
    import torch
    infinity = load(megatrain_dir)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s [%(levelname)s] %(message)s")
    config = _config(infinity, batch, seq, clip, devices)
    data_parallel = bool(devices) and len(devices) > 1
    model = infinity.CPUMasterModel(hf_model, config)
    params = model.get_parameters()
    opt, name = _optimizer(params, config)
    timings = []  # its own CUDA-event timings of each step's forward and backward

    def step(ids):
        mask = torch.ones_like(ids)
        loss, _, timing = model.forward_and_backward(ids, mask, ids)
        timings.append(timing)
        if data_parallel and any(p.grad is None for p in params):
            raise RuntimeError("MegaTrain data parallel: a parameter without its shared-memory "
                               "grad: this step would not train it")
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        model._sync_params_to_gpu()
        model.zero_grad()
        # Data parallel: its train.py's optimizer.zero_grad() (set_to_none, torch's default)
        # would detach the shared-memory grads its workers add into from this process's
        # parameters, so that from the second step on the clip and the update see no grads
        # and train nothing; model.zero_grad() has zeroed every one of them in place already.
        if not data_parallel:
            opt.zero_grad()
        return loss

    def report(warmup):
        import statistics
        measured = [t for t in (timings[warmup:] or timings) if t]
        if not measured or not all("forward" in t and "backward" in t for t in measured):
            return {}
        return {"megatrain_forward_backward_seconds": [
            statistics.median(t["forward"] for t in measured),
            statistics.median(t["backward"] for t in measured)]}

    def workers():
        return [p.pid for p in getattr(model, "worker_processes", [])]

    from infinity.model.cpu_master import FLASH_CE_AVAILABLE
    info = {"optimizer": name, "megatrain_commit": _commit(megatrain_dir),
            # Where this run departs from its Llama-3-8B recipe, and why: no flash-attn here;
            # every mode's AdamW hyperparameters (a step's time does not depend on them).
            "megatrain_vs_recipe": "attn sdpa (recipe: flash_attention_2), lr %g and weight "
                                   "decay %g (recipe: 2e-05, 0.01), random tokens (recipe: a "
                                   "chat dataset, padded)%s" % (
                                       config.learning_rate, config.weight_decay,
                                       "; data parallel: the optimizer's grads zeroed in place "
                                       "(its train.py sets them to None, which detaches the "
                                       "workers' shared grads after the first step)"
                                       if data_parallel else ""),
            "plan": "MegaTrain%s: weights, grads and optimizer state on the CPU, 2 layer "
                    "buffers on the device, a checkpoint every %d layers, %d grad slabs, "
                    "loss %s" % (
                        " data parallel over %d GPUs (a worker process each, grads added in "
                        "shared memory)" % len(devices) if devices and len(devices) > 1 else "",
                        CHECKPOINT_INTERVAL, NUM_GRAD_SLABS,
                        "flash-attn's cross-entropy" if FLASH_CE_AVAILABLE
                        else "torch's cross-entropy, 128 positions at a time")}
    info["placement"] = info["plan"] + "; optimizer " + name
    return types.SimpleNamespace(step=step, info=info, report=report, workers=workers,
                                 close=model.cleanup)


def dry_run(megatrain_dir, hf_model, batch, seq, clip, devices=None):
    """Without CUDA (MegaTrain's training needs it): MegaTrain imported, its configuration for
    this run built, and its layers run on the CPU as it runs them (the kwargs from its own
    _build_layer_kwargs, the rotary embeddings as it computes them) against the model's own
    forward pass, which they must equal: the sdpa mask patch checked. A dict for the run's
    JSON."""
    import torch
    infinity = load(megatrain_dir)
    from infinity.model.cpu_master import (CPUMasterModel, _discover_model_components,
                                           _introspect_layer_forward)
    config = _config(infinity, batch, seq, clip, devices)
    parts = _discover_model_components(hf_model)
    accepts = _introspect_layer_forward(parts["layers"][0])
    ids = torch.randint(0, hf_model.config.vocab_size, (2, seq),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if CPUMasterModel._layer_attention_mask(mask, "sdpa", config.dtype) is not None:
        raise SystemExit("MegaTrain's patched mask: not None for sdpa without padding")
    padded = mask.clone()
    padded[0, -1] = 0
    if CPUMasterModel._layer_attention_mask(padded, "sdpa", config.dtype).dim() != 4:
        raise SystemExit("MegaTrain's patched mask: not the 4-D mask with padding")
    # Its _build_layer_kwargs reads these of the model (a stand-in: CPUMasterModel itself
    # allocates pinned and device memory as it is built).
    stand_in = types.SimpleNamespace(
        config=config, _layer_attention_mask=CPUMasterModel._layer_attention_mask,
        layer_accepts_cache_position="cache_position" in accepts,
        layer_accepts_position_embeddings="position_embeddings" in accepts,
        layer_accepts_position_ids="position_ids" in accepts)
    seq_len = ids.shape[1]
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(ids.shape[0], -1)
    head_dim = hf_model.config.hidden_size // hf_model.config.num_attention_heads
    cos, sin = parts["rotary_emb"](torch.empty((1, 1, seq_len, head_dim)), position_ids[:1])
    kwargs = CPUMasterModel._build_layer_kwargs(
        stand_in, mask, torch.arange(seq_len), position_ids,
        (cos.to(config.dtype), sin.to(config.dtype)))
    with torch.no_grad():
        hidden = parts["embedding"](ids)
        for layer in parts["layers"]:
            out = layer(hidden, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = parts["norm"](hidden)
        expected = hf_model.model(ids).last_hidden_state
    diff = (hidden.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    if not diff <= 1e-2 * max(scale, 1.0):
        raise SystemExit("MegaTrain's layers with the patched mask differ from the model's own "
                         "forward pass: max |diff| %.3g (values up to %.3g)" % (diff, scale))
    try:
        import deepspeed.ops.adam  # noqa: F401
        optimizer = "DeepSpeedCPUAdam"
    except Exception:
        optimizer = "torch.optim.AdamW on the CPU (DeepSpeed not importable)"
    return {"dry_run": "MegaTrain %s imported from %s; config: batch %d x %d%s, clip %g, sdpa, "
                       "checkpoint_interval %d, %d grad slabs; its layers with the patched mask "
                       "equal the model's forward (max |diff| %.2g); optimizer would be %s"
                       % (_commit(megatrain_dir) or "(commit unknown)", megatrain_dir, batch, seq,
                          " over %d devices" % len(devices) if devices and len(devices) > 1
                          else "", clip, CHECKPOINT_INTERVAL, NUM_GRAD_SLABS, diff, optimizer),
            "megatrain_commit": _commit(megatrain_dir), "optimizer": optimizer,
            "layer_max_abs_diff": diff}
