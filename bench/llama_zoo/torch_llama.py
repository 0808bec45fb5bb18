"""A self-contained Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU) for tests, examples and benchmarks, with size presets. It follows the Hugging Face
layout (model.embed_tokens, model.layers[i], model.norm, lm_head) and calling convention
(`model(ids, labels=ids).loss`), so strata.torch treats it like LlamaForCausalLM."""
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


from .shapes import LlamaConfig, PRESETS, flops_per_token  # noqa: F401  (shared with jax_llama)


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(config, seq, device, dtype):
    dim = config.hidden_size // config.num_attention_heads
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim))
    freqs = torch.outer(torch.arange(seq, device=device).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


@dataclasses.dataclass
class CausalLMOutput:
    loss: torch.Tensor = None
    logits: torch.Tensor = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        """Per module (Hugging Face's convention), so a model built on the meta device can be
        materialized block by block (strata.torch.offload does)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)

    def forward(self, input_ids, labels=None):
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary(self.config, input_ids.shape[1], x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        h = self.model.norm(x)
        if labels is not None and getattr(self.config, "loss_impl", "torch") == "liger":
            # Liger's fused linear cross-entropy: the same loss, the logits computed a chunk
            # of tokens at a time and never held whole (their grads computed in the forward).
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            loss = liger_fused_linear_cross_entropy(
                h[:, :-1].reshape(-1, h.shape[-1]), self.lm_head.weight,
                labels[:, 1:].reshape(-1), accum_dtype=torch.float32)
            return CausalLMOutput(loss=loss)
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            # Next-token prediction, as Hugging Face's causal LMs compute it.
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


