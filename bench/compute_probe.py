"""The compute the placement's step model is given (bench/train_bench.py's strata mode): one
block's forward and backward passes, the head and loss, and the resident update, each timed
alone on the device on a fresh block of the model's shape."""
import statistics

from bench_models import probe_block


def probe_compute(config, batch, seq, device, impl="zoo", chunked_loss=False):
    """Device seconds, each measured alone on a fresh block of the model's shape: one block's
    forward pass (no grad, as a checkpointed block's first pass); its backward pass as
    strata.torch runs it, checkpointed (the forward recomputed, then the backward), kept
    selectively (the elementwise part recomputed) and kept wholly (no recompute); the rest of
    a step (the head and the loss, forward and backward); and the resident update per
    parameter (fp32 grads from the bf16 ones, torch's fused AdamW on fp32 masters, the bf16
    weights written back: strata.torch.AdamW's resident step). The compute the placement's
    step model is given, measured apart from the step it predicts."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    from strata.torch._measure import selective_bytes, selective_context

    dtype = torch.bfloat16
    block, x, args, kwargs = probe_block(config, impl, batch, seq, device, dtype)

    def run_block(h):
        out = block(h, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(x)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(device, dtype)
    labels = torch.randint(0, config.vocab_size, (batch * seq,), device=device)

    def timed(fn, reps=3, before=None):
        """Median seconds of fn(before()) over reps, before() run outside the timing."""
        fn(before() if before else None)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            arg = before() if before else None
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(arg)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    def forward(_):
        with torch.no_grad():
            run_block(x)

    def backward(_):
        run_block(x).backward(g)

    measured = selective_bytes(block.forward, (x,) + tuple(args), kwargs, device)
    limit = measured[1] if measured else None

    def kept(selective):
        def run():
            if selective:
                return checkpoint(run_block, x, use_reentrant=False,
                                  context_fn=lambda: selective_context(limit))
            return run_block(x)
        return run

    def backward_only(out):
        out.backward(g)

    def rest(_):
        h = x.detach().requires_grad_().view(-1, config.hidden_size)
        if chunked_loss:  # strata.torch's loss over chunks of tokens (offload's default)
            from strata.torch._chunked_loss import linear_cross_entropy
            linear_cross_entropy(h, head.weight, None, labels).backward()
            return
        if getattr(config, "loss_impl", "torch") == "liger":
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            liger_fused_linear_cross_entropy(h, head.weight, labels,
                                             accum_dtype=torch.float32).backward()
            return
        F.cross_entropy(head(h).float(), labels).backward()

    weights = list(block.parameters())
    masters = [p.detach().float().requires_grad_() for p in weights]
    for p in weights:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1, fused=True)

    def update(_):
        for p, m in zip(weights, masters):
            m.grad = p.grad.float()
        adamw.step()
        with torch.no_grad():
            for p, m in zip(weights, masters):
                m.grad = None
                p.copy_(m)

    out = dict(forward=timed(forward), backward=timed(backward),
               backward_selective=timed(backward_only, before=kept(True)),
               backward_whole=timed(backward_only, before=kept(False)), rest=timed(rest),
               update_per_param=timed(update) / sum(p.numel() for p in weights))
    del block, head, x, g, weights, masters, adamw
    torch.cuda.empty_cache()
    return out
