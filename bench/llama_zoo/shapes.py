"""Llama-style model shapes shared by llama_zoo.torch_llama and llama_zoo.jax_llama: the config,
the size presets and the FLOP counts. No framework import."""
import dataclasses


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def parameters(self):
        """Parameter count."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h // self.num_attention_heads * self.num_key_value_heads
        block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        return self.num_hidden_layers * block + v * h * (1 if self.tie_word_embeddings else 2) + h


# Llama-style shapes at the usual sizes (random init; 1b/3b/7b/14b after Llama 3.2 1B/3B,
# Llama 2 7B and Qwen2.5 14B, vocabularies rounded to 32000 to keep the head a fair share).
PRESETS = {
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512),
    "125m": LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12),
    "1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    "3b": LlamaConfig(vocab_size=32000, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8),
    "7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    # Llama 3.1 8B's shapes (its vocabulary 128256, untied head, rope theta 500000), as
    # bench/dist_bench.py's "8b".
    "8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rope_theta=500000.0),
    "14b": LlamaConfig(vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                       num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8),
}


def flops_per_token(config, seq):
    """Training FLOPs per token: (6 P, the count MegaTrain reports, and the work actually done:
    6 P plus the blocks' recomputed forward (2 P_blocks) plus causal attention, whose forward is
    2 seq h per layer (QK^T and AV over half the positions), done 4 times (forward, recomputed
    forward, twice in backward))."""
    p = config.parameters()
    blocks = p - config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    attention_forward = 2 * seq * config.hidden_size * config.num_hidden_layers
    return 6 * p, 6 * p + 2 * blocks + 4 * attention_forward
