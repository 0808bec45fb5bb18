"""strata.jax: train a JAX model whose repeated blocks stream through Strata.

    trainer = strata.jax.Trainer(block_fn, blocks, residents, embed_fn=..., loss_fn=...,
                                 optimizer=optax.adamw(3e-4),
                                 block_optimizer=strata.jax.AdamW(3e-4, weight_decay=0.1))
    for batch in batches:
        loss = trainer.step(batch)

The blocks' weights live in Strata's DRAM (or NVMe) and are handed to JAX zero-copy through
DLPack from each acquired layer's device views; each block's forward and its recomputed
forward + vjp are jitted per layer; grads go back into the runtime's grad views, and the
runtime's CPU AdamW updates fp32 masters as soon as a block's grads land. The residents
(embedding, head, ...) stay on the device, trained by any optax optimizer. See docs/python.md."""
from .streamed import AdamW, Trainer  # noqa: F401
