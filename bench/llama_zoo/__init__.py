"""The Llama-style model zoo of Strata's tests, examples and benchmarks (not shipped with the
strata package): shapes and size presets (shapes), the decoder in PyTorch (torch_llama) and in
plain jax.numpy (jax_llama), a strata.jax trainer for the latter (jax_trainer), and the same
decoder of Flax NNX's own layers for strata.jax.offload (nnx_llama; needs flax).

Scripts in bench/ import it directly; examples/ put bench/ on sys.path, tests/python has
it on pytest's pythonpath (pyproject.toml)."""
from .shapes import LlamaConfig, PRESETS, flops_per_token  # noqa: F401
