"""strata.jax: train a JAX transformer whose blocks stream through Strata.

The blocks' weights live in Strata's DRAM (or NVMe) and are handed to JAX zero-copy through
DLPack from each acquired layer's device views; each block's forward and its recomputed
forward + vjp are jitted per layer; grads go back into the runtime's grad views, and the
runtime's CPU AdamW updates fp32 masters as soon as a block's grads land. See
docs/python.md."""
from .trainer import StreamedTrainer  # noqa: F401
from . import models  # noqa: F401
