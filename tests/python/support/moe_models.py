"""Tiny mixture-of-experts models of every family users fine-tune (Mixtral, Qwen3-MoE, OLMoE,
GPT-OSS, DeepSeek-V3), for the CPU tests of strata.torch's MoE support: hidden 32, 2 layers,
4 experts of which 2 are active a token, vocab 128 (torch_parity_models.VOCAB)."""
import torch

from torch_parity_models import DEVICE, VOCAB

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# name: (config class, model class, what differs from COMMON)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=8, num_experts=4, moe_intermediate_size=16)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=8, num_local_experts=4, sliding_window=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1,
                         moe_intermediate_size=16, first_k_dense_replace=1, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                         v_head_dim=8, head_dim=4)),
}
# The families whose forward adds the router's auxiliary loss (output_router_logits=True).
ROUTED = ("mixtral", "qwen3_moe", "gpt_oss")


def moe_model(name, seed=0, **extra):
    """A freshly initialized tiny model of family `name` in train mode on the suites' device,
    eager attention; `extra` overrides its config (experts_implementation=, the router's
    loss). Skipped where this transformers lacks the family."""
    import pytest
    import transformers
    config_name, model_name, differs = FAMILIES[name]
    config_class = getattr(transformers, config_name, None)
    model_class = getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        pytest.skip("transformers %s has no %s" % (transformers.__version__, model_name))
    cfg = config_class(**{**COMMON, **differs, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_class(cfg).train().to(DEVICE)


def experts_implementations():
    """The experts implementations of Hugging Face's own that run on any device, as this
    transformers has them: "eager" (the experts class's loop over the experts hit), and its
    registered "batched_mm" and "grouped_mm" (the kernels from the Hub, deepgemm and sonicmoe,
    are CUDA-only)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ("eager",)
    return ("eager",) + tuple(n for n in ("batched_mm", "grouped_mm")
                              if n in ALL_EXPERTS_FUNCTIONS.keys())
