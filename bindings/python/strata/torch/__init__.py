"""strata.torch: train a PyTorch model larger than the GPU's memory by streaming its blocks,
with the semantics of plain PyTorch.

    model = strata.torch.offload(model, gpu_budget=..., host_budget=...)
    opt = strata.torch.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

The repeated blocks (model.model.layers of Hugging Face decoders, transformer.h of GPT-2, or
the largest nn.ModuleList) live in Strata's pinned DRAM; each is streamed into HBM for its
forward pass and again for its recomputed forward and backward pass (activation checkpointing
per block, RNG-exact), its parameters pointing at the executor's slot memory through DLPack.
Their grads go to DRAM and show as each parameter's .grad (strata.torch.StreamedGrad): norms,
clipping, scaling and zeroing work on them as on any grad. strata.torch.AdamW (and Adam, SGD,
Lion, Adagrad) is a torch.optim.Optimizer: at step() Strata's CPU optimizer of the same kind
updates the blocks' fp32 masters while the next forward pass runs, and torch's (Lion: the same
formula in torch) the resident parameters (embedding, final norm, head).
Whole-state checkpoints: strata.torch.save_checkpoint / load_checkpoint. The streamed
parameters' values in a with-block (EMA, logging, writes): strata.torch.gathered. The Hugging
Face Trainer, data parallel under torchrun without DDP: strata.torch.StrataTrainer (imported on
first use: transformers stays optional). See docs/python-guide.md and docs/python-reference.md.

The names above are the package's surface; its modules are private (a leading underscore, or
in a folder of one layer: session/, optim/), layered bottom to top as
tests/python/core/test_package_layering.py declares."""
from ._checkpoint import load_checkpoint, save_checkpoint
from ._context_parallel import ContextParallel, ContextParallelError, context_parallel
from ._distributed import DataParallel, DataParallelError
from ._gathered import gathered
from ._grads import StreamedGrad
from ._offload import offload
from .optim.kinds import Adagrad, Adam, AdamW, Lion, SGD

__all__ = ["offload", "AdamW", "Adam", "SGD", "Lion", "Adagrad", "StreamedGrad",
           "save_checkpoint", "load_checkpoint", "DataParallel", "DataParallelError", "gathered",
           "context_parallel", "ContextParallel", "ContextParallelError"]


def __getattr__(name):
    # StrataTrainer subclasses transformers.Trainer: transformers is imported only when it is
    # first used, so strata.torch works without it (and it is not in __all__: a star import
    # would import transformers).
    if name == "StrataTrainer":
        from ._hf_trainer import StrataTrainer
        return StrataTrainer
    raise AttributeError("module 'strata.torch' has no attribute %r" % (name,))
