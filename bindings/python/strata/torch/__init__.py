"""strata.torch: train a PyTorch model larger than the GPU's memory by streaming its blocks.

    model = strata.torch.offload(model, gpu_budget=..., host_budget=..., nvme=[...])
    opt = strata.torch.AdamW(model, lr=3e-4, weight_decay=0.1)
    for ids in batches:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

The repeated blocks (model.model.layers of Hugging Face decoders such as LlamaForCausalLM and
Qwen2ForCausalLM, or the largest nn.ModuleList) live in Strata's pinned DRAM (or NVMe); each is
streamed into HBM for its forward pass and again for its recomputed forward and backward pass
(activation checkpointing per block), its parameters pointing at the executor's slot memory
through DLPack (no copy to bind them), its grads sent back to DRAM where the runtime's CPU
optimizer updates fp32 masters while the GPU computes the blocks below. Everything else
(embedding, final norm, head) stays resident on the device, trained by an fp32-master AdamW
there."""
from .offload import offload, AdamW, StrataSession  # noqa: F401
from . import models  # noqa: F401
