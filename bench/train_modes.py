"""The steps bench/train_bench.py times for its peers' modes: plain PyTorch's (the resident and
FSDP2 modes), DeepSpeed ZeRO-3's engine on one GPU, and --accum's micro-batches."""
import os

from bench_models import checkpoint_blocks, hf_config


def setup_deepspeed(config, mode, batch, clip, nvme, param_buffers=16, impl="zoo"):
    """DeepSpeed ZeRO-3 on this one GPU (a process group of one), the model built partitioned
    under zero.Init, blocks checkpointed as strata.torch's are, bf16, its CPU AdamW. Offloaded to
    NVMe (ZeRO-Infinity: bf16 parameters and the fp32 optimizer state in a directory beside
    the --nvme file, through its libaio op) or to pinned DRAM. Weights start from torch's
    default initialization (zero.Init partitions each module as it is built, before the
    model's own init could run), so its losses start elsewhere than the other modes'."""
    import deepspeed
    import torch

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29518"), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    torch.cuda.set_device(0)
    import deepspeed_peer  # the ZeRO-3 configuration, one copy for this bench and dist_bench

    path = None
    if mode == "deepspeed-nvme":
        if not nvme:
            raise SystemExit("deepspeed-nvme needs --nvme PATH (its files go to PATH.deepspeed/)")
        path = nvme + ".deepspeed"
        os.makedirs(path, exist_ok=True)
    largest = max(config.vocab_size * config.hidden_size,
                  config.hidden_size * config.intermediate_size)
    ds_config = deepspeed_peer.config(batch, clip, path, largest, param_buffers)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        if impl == "hf":  # built partitioned, with Hugging Face's own init (quick on the GPU)
            from transformers import LlamaForCausalLM
            model = LlamaForCausalLM._from_config(hf_config(config), attn_implementation="sdpa",
                                                  dtype=torch.bfloat16)
        else:
            from llama_zoo.torch_llama import LlamaForCausalLM
            model = LlamaForCausalLM(config)
    checkpoint_blocks(model, impl)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    return engine


def accumulation():
    """--accum: micro-batches a step (every mode but deepspeed's)."""
    return int(os.environ.get("STRATA_BENCH_ACCUM", "1"))


def plain_step(model, opt, clip, autocast):
    """One step of plain PyTorch: autocast to bf16 (resident modes), backward, clip, step."""
    import torch

    def step(ids):
        total = 0.0  # the micro-batches' mean loss: the whole batch's
        for part in ids.chunk(accumulation()):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(part, labels=part).loss / accumulation()
            loss.backward()
            total = total + loss.detach()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total
    return step


def engine_step(engine):
    """One step of a DeepSpeed engine (its config clips)."""
    def step(ids):
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step
