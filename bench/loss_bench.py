#!/usr/bin/env python3
"""The head and the causal-LM loss alone on the GPU: Hugging Face's way (the whole logits,
`.float()`, `cross_entropy`) against strata.torch's chunked loss
(strata.torch._chunked_loss.linear_cross_entropy) at several chunk sizes. The 8B's head
(hidden 4096, vocabulary 128256, bf16), forward and backward, the median of 5 timed runs after
one warm-up, and the peak device memory allocated.

    STRATA_LIBRARY=... python bench/loss_bench.py
"""
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bindings" / "python"))
from strata.torch import _chunked_loss as cl  # noqa: E402

H, V = 4096, 128256
DEVICE = "cuda"


def whole(weight):
    def loss(h, labels):
        return F.cross_entropy(F.linear(h, weight).float().view(-1, V), labels.view(-1))
    return loss


def chunked(weight, chunk):
    def loss(h, labels):
        return cl.linear_cross_entropy(h.view(-1, H), weight, None, labels.view(-1),
                                       chunk_tokens=chunk)
    return loss


def bench(name, fn, weight, n):
    h = torch.randn(n, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (n,), device=DEVICE)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(h, labels).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        h.grad = weight.grad = None
    times = sorted(times[1:])
    print("%-14s tokens %6d: %.1f ms (peak %.1f GB)"
          % (name, n, times[2] * 1e3, torch.cuda.max_memory_allocated() / 1e9), flush=True)


def main():
    torch.manual_seed(0)
    weight = (torch.randn(V, H, device=DEVICE) * 0.02).to(torch.bfloat16).requires_grad_()
    for n in (32768, 65536):
        if n <= 32768:  # the whole logits of 64k tokens alone take 50 GB
            bench("hf", whole(weight), weight, n)
        for chunk in (2088, 4096, 8192, 16384):
            bench("chunk %d" % chunk, chunked(weight, chunk), weight, n)


if __name__ == "__main__":
    main()
