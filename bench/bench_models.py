"""The models the training benchmarks train (bench/train_bench.py, bench/dist_bench.py and the
peers they run): a preset or spec's shape, Hugging Face's LlamaForCausalLM or llama_zoo's built
from it, the seeded fast init every mode and peer shares, checkpointed blocks as strata.torch's
streamed blocks run, and one block alone for the compute probe."""

def model_config(name):
    """A preset, or "h4096-l40-i14336-kv8-v32000"."""
    from llama_zoo import LlamaConfig, PRESETS
    if name in PRESETS:
        return PRESETS[name]
    try:
        f = {part[0] if part[0] != "k" else "kv": int(part.lstrip("hlikv"))
             for part in name.split("-")}
        h = f["h"]
        return LlamaConfig(vocab_size=f["v"], hidden_size=h, intermediate_size=f["i"],
                           num_hidden_layers=f["l"], num_attention_heads=h // 128,
                           num_key_value_heads=f["kv"])
    except (KeyError, ValueError):
        raise SystemExit("model %r: not a preset (%s) nor a spec like h4096-l40-i14336-kv8-v32000"
                         % (name, ", ".join(PRESETS)))


def hf_config(config):
    """Hugging Face's LlamaConfig of a llama_zoo shape (sdpa attention, no KV cache)."""
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size,
                       num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads,
                       max_position_embeddings=config.max_position_embeddings,
                       rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       tie_word_embeddings=config.tie_word_embeddings, use_cache=False)


def build_model(config, impl, device, dtype=None):
    """The model of `config` built on `device`: Hugging Face's LlamaForCausalLM (impl "hf",
    sdpa) or llama_zoo's (impl "zoo"). On the meta device (for st.offload, which initializes
    each block as it places it, with model._init_weights) nothing is allocated; elsewhere the
    weights are initialized. The Hugging Face model's init is fast_init (seeded,
    the same in every mode and in MegaTrain's; Hugging Face's own takes minutes for 8B on
    the CPU)."""
    import torch
    if impl == "zoo":
        from llama_zoo.torch_llama import LlamaForCausalLM
        with torch.device(device):
            return LlamaForCausalLM(config)
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(hf_config(config), attn_implementation="sdpa",
                                              **({"dtype": dtype} if dtype else {}))
    model._init_weights = fast_init
    if torch.device(device).type != "meta":
        materialize(model, device)
    return model


def materialize(model, device):
    """A Hugging Face model built on meta (or whose storage was dropped by to_empty) given
    storage on `device` and fast_init's values; the rotary inverse frequencies (a buffer that
    is not in the state dict, left uninitialized by to_empty) computed again."""
    model.to_empty(device=device)
    model.apply(model._init_weights)
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)


def checkpoint_blocks(model, impl):
    """Each decoder block recomputed in the backward pass (non-reentrant torch checkpointing),
    as strata.torch's streamed blocks are."""
    if impl == "hf":
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    from torch.utils.checkpoint import checkpoint
    for block in model.model.layers:
        forward = block.forward
        block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(forward)


def probe_block(config, impl, batch, seq, device, dtype):
    """One decoder block of the model's kind on the device, its input x and the other
    arguments it is called with: (block, x, args, kwargs), block(x, *args, **kwargs)."""
    import torch
    x = torch.randn(batch, seq, config.hidden_size, device=device, dtype=dtype,
                    requires_grad=True)
    if impl == "zoo":
        from llama_zoo.torch_llama import DecoderLayer, rotary
        return DecoderLayer(config).to(device, dtype), x, rotary(config, seq, device, dtype), {}
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = hf_config(config)
    cfg._attn_implementation = "sdpa"
    block = LlamaDecoderLayer(cfg, layer_idx=0).to(device, dtype)
    positions = torch.arange(seq, device=device).unsqueeze(0)
    cos, sin = LlamaRotaryEmbedding(cfg).to(device)(x, positions)
    return block, x, (), dict(position_embeddings=(cos.to(dtype), sin.to(dtype)),
                              attention_mask=None, position_ids=positions)


_TILE = {}


def fast_init(module):
    """A seeded init every rank and every run computes alike, at memory speed: element k of a
    weight is element k mod 1,000,003 of one tile of normal values (std 0.02), norms are ones.
    Stands in for Hugging Face's _init_weights, which takes minutes for 8B parameters on the
    CPU. An FSDP2 parameter (a DTensor sharded on dim 0) gets its shard of the same values."""
    import torch
    from torch import nn
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.is_meta:
        return
    with torch.no_grad():
        local, start = weight, 0
        if hasattr(weight, "to_local"):  # FSDP2: rows [rank * ceil(R / W), ...) of the whole
            import torch.distributed as dist
            local = weight.to_local()
            rows = weight.shape[0]
            per = -(-rows // dist.get_world_size())
            start = min(dist.get_rank() * per, rows) * (weight.numel() // max(rows, 1))
        if "norm" in type(module).__name__.lower():
            local.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            fill_tiled(local, start)


def fill_tiled(tensor, start=0):
    """fast_init's values into `tensor` (contiguous, under no_grad): element k is element
    (start + k) mod 1,000,003 of one seeded tile of normal values (std 0.02)."""
    import torch
    key = (tensor.device, tensor.dtype)
    if key not in _TILE:
        g = torch.Generator().manual_seed(0)
        _TILE[key] = (torch.randn(1_000_003, generator=g) * 0.02).to(*key)
    tile, flat, pos = _TILE[key], tensor.view(-1), 0
    while pos < flat.numel():
        k = (start + pos) % tile.numel()
        n = min(tile.numel() - k, flat.numel() - pos)
        flat[pos:pos + n].copy_(tile[k:k + n])
        pos += n
