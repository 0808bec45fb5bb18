#!/usr/bin/env python3
"""Train the Llama-style model in JAX (plain jax.numpy) with its blocks streamed through Strata:
weights handed to JAX zero-copy through DLPack, per-layer jitted forward and vjp with
recomputation, grads back to the runtime, Strata's CPU AdamW on fp32 masters. Bundled text
(bytes as tokens), nothing downloaded; GPU if JAX has one, the CPU and the host backend if not.

    python examples/train_jax.py [--model tiny] [--steps 30]
"""
import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave HBM to Strata too
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
sys.path.insert(0, str(ROOT / "bench"))  # llama_zoo, the Llama-style model of the examples

import numpy as np  # noqa: E402

from llama_zoo import jax_llama as models  # noqa: E402
from llama_zoo.jax_trainer import StreamedTrainer  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(models.PRESETS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args()
    config = models.PRESETS[args.model]
    blocks, residents = models.init_params(config, seed=0)
    trainer = StreamedTrainer(config, blocks, residents, lr=args.lr, weight_decay=0.1)
    print("each step: %s" % ("one XLA program (FFI acquire/release ops)" if trainer.uses_ffi
                             else "the host-synchronised loop"), flush=True)
    text = np.frombuffer((ROOT / "examples" / "data" / "corpus.txt").read_bytes(), np.uint8)
    text = text.astype(np.int32) % config.vocab_size
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(text) - args.seq - 1, args.batch)
        ids = np.stack([text[s:s + args.seq] for s in starts])
        loss = trainer.step(ids)
        if step == 1 or step % 10 == 0 or step == args.steps:
            print("step %4d/%d loss %.4f  %.0f tokens/s" % (
                step, args.steps, loss, args.batch * args.seq * step / (time.perf_counter() - start)),
                flush=True)
    trainer.synchronize()
    print("optimizer: %d updates on %s" % (trainer.optimizer.stats()["step"],
                                          trainer.runtime.backend))
    trainer.close()


if __name__ == "__main__":
    main()
