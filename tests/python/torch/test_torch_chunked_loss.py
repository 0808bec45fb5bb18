"""The causal-LM loss over chunks of tokens (strata.torch._chunked_loss, issue 36 item 1)
against the model's own loss: Hugging Face's ForCausalLMLoss on the whole logits, and the
package's own Llama's.

Each test runs the same model (one deepcopy each side, same seed, same data) once plainly and
once with the chunked loss installed, and compares the loss and every parameter's grad. The
models are tiny (hidden 64, vocabulary 320) and the chunks smaller than the batch (3 x 13 = 39
tokens in chunks of 8: five chunks, the last one of 7), so several chunks and an uneven last
one run. Tolerances (the module's docstring): fp32 within FP32_RTOL of each tensor's scale
(the chunked sums are formed in another order); bf16 within BF16_RTOL (the head's weight grad
is summed in fp32 over the chunks and rounded once, where the whole-batch product rounds its
own way). The CPU always runs; the GPU too when
there is one (or STRATA_PARITY_DEVICE=cuda), with TF32 off, plus a peak-memory check."""
import copy
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from strata.torch import _chunked_loss as cl  # noqa: E402

import torch_parity_models as tpm  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 320
BATCH, SEQ = 3, 13  # 39 tokens
CHUNK = 8  # five chunks, the last one of 7 tokens
HF_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")

# The documented tolerance (strata.torch._chunked_loss). Measured on the CPU: fp32 losses
# within 1e-7 relative, grads within 1.4e-6 of their scale (GPT-2's ln_f.bias); bf16 losses
# within 2e-7, grads within 1.5e-4 (the CPU's bf16 products sum in fp32 and round once, as
# the chunked weight grad does). A GPU's products round their own way: bf16 allows a few bf16
# roundings (2^-8 = 3.9e-3 each). `pytest -s` prints what each parity test measured.
FP32_LOSS_RTOL = 1e-6
FP32_RTOL = 1e-5
BF16_LOSS_RTOL = 1e-3
BF16_RTOL = 2e-2


def _devices():
    found = ["cpu"]
    if os.environ.get("STRATA_PARITY_DEVICE", "cpu").startswith("cuda") or \
            torch.cuda.is_available():
        found.append("cuda")
    return found


DEVICES = _devices()


@pytest.fixture(autouse=True, scope="module")
def _one_thread_no_tf32():
    """Tiny models: one intra-op thread (see conftest.one_torch_thread). On a GPU, fp32 means
    fp32: TF32 off on both sides. Both restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = tf32


# ---------------------------------------------------------------------------------------------
# Models, data and the two sides.

def hf_model(arch, device="cpu", dtype=torch.float32, tie=None, seed=0):
    """A tiny Hugging Face causal LM (torch_parity_models' config, vocabulary VOCAB), its head
    scaled up so that the softmax is far from uniform (a sharper test of the grads)."""
    if arch == "qwen3":  # not among torch_parity_models' architectures: its shapes
        cfg = transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        cfg._attn_implementation = "eager"
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = tpm.config(arch)
        cls = tpm.model_class(arch)
    cfg.vocab_size = VOCAB
    if tie is not None:
        cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return model.train().to(device=device, dtype=dtype)


def zoo_model(device="cpu", dtype=torch.float32, seed=0):
    """The package's own Llama (bench/llama_zoo), tiny."""
    from llama_zoo.torch_llama import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model.train().to(device=device, dtype=dtype)


def tokens(device, batch=BATCH, seq=SEQ, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g).to(device)


def padded(ids):
    """Labels with -100 where a real batch pads: the tail of one row, all of another."""
    labels = ids.clone()
    labels[0, -4:] = -100
    labels[2, :] = -100
    return labels


def pair(model, chunk_tokens=CHUNK):
    """(plain copy, the model with the chunked loss installed)."""
    plain = copy.deepcopy(model)
    cl.install(model, chunk_tokens=chunk_tokens)
    return plain, model


def run(model, backward=True, scale=1.0, **inputs):
    out = model(**inputs)
    if backward:
        (out.loss * scale).backward()
    return out


def grads(model):
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def rel(got, expected):
    """max |got - expected| over max |expected| (0 for two zero tensors)."""
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    scale = expected.abs().max().item()
    diff = (got - expected).abs().max().item()
    return diff / scale if scale else diff


def assert_close(got_loss, expected_loss, got_grads, expected_grads, dtype=torch.float32,
                 label=None):
    """Loss and grads within the tolerance of `dtype`; `label`: print what was measured."""
    loss_rtol, rtol = ((FP32_LOSS_RTOL, FP32_RTOL) if dtype == torch.float32 else
                       (BF16_LOSS_RTOL, BF16_RTOL))
    assert got_loss.dtype == expected_loss.dtype == torch.float32
    assert torch.isfinite(expected_loss)
    loss_rel = abs(got_loss.item() - expected_loss.item()) / abs(expected_loss.item())
    if label is not None:
        worst = max(((rel(got_grads[n], e), n) for n, e in expected_grads.items()
                     if e is not None and got_grads.get(n) is not None), default=(0.0, None))
        print("\nmeasured %s: loss %.2e relative, grads %.2e of their scale (%s)"
              % (label, loss_rel, worst[0], worst[1]))
    assert loss_rel <= loss_rtol, (got_loss.item(), expected_loss.item())
    assert sorted(got_grads) == sorted(expected_grads)
    bad = []
    for name, e in expected_grads.items():
        g = got_grads[name]
        if (g is None) != (e is None):
            bad.append("%s: grad %s, plain %s" % (name, g is None and "None",
                                                  e is None and "None"))
            continue
        if e is None:
            continue
        assert g.shape == e.shape and g.dtype == e.dtype, (name, g.shape, g.dtype, e.dtype)
        r = rel(g, e)
        if r > rtol:
            bad.append("%s: %.3g of its scale" % (name, r))
    assert not bad, "\n".join(bad)


def head_shapes(model):
    """A list receiving the shape of every output of the model's head (a forward hook
    registered after install: what the head really computed)."""
    seen = []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
        else model.lm_head
    head.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    return seen


# ---------------------------------------------------------------------------------------------
# Parity: every architecture, fp32 and bf16, CPU and GPU.

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", HF_ARCHS + ("zoo",))
def test_loss_and_every_grad_match(arch, dtype, device):
    model = zoo_model(device, dtype) if arch == "zoo" else hf_model(arch, device, dtype)
    plain, chunked = pair(model)
    ids = tokens(device)
    seen = head_shapes(chunked)
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    # The head never produced the batch's logits: the chunked loss computed them a chunk at a
    # time, outside the head's forward.
    assert seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain), dtype,
                 label="%s %s %s" % (arch, str(dtype)[6:], device))
    # out.logits after labels: computed on first access, the model's own values and dtype.
    assert got.logits.dtype == expected.logits.dtype
    assert rel(got.logits, expected.logits) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert seen[-1] == (BATCH, SEQ, VOCAB)


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_padded_labels(arch):
    plain, chunked = pair(hf_model(arch))
    ids = tokens("cpu")
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    labels = padded(ids)
    expected = run(plain, input_ids=ids, attention_mask=mask, labels=labels)
    got = run(chunked, input_ids=ids, attention_mask=mask, labels=labels)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_all_labels_ignored_is_nan_like_the_model():
    """Mean over no tokens: Hugging Face's loss is nan (0/0); so is the chunked one."""
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    labels = torch.full_like(ids, -100)
    expected = plain(input_ids=ids, labels=labels).loss
    got = chunked(input_ids=ids, labels=labels).loss
    assert torch.isnan(expected) and torch.isnan(got)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_num_items_in_batch(arch, as_tensor):
    """The Trainer's num_items_in_batch: the sum over the batch divided by it."""
    plain, chunked = pair(hf_model(arch))
    ids = tokens("cpu")
    labels = padded(ids)
    n = 57  # the Trainer counts over all micro-batches of the step: not this batch's count
    n = torch.tensor(n) if as_tensor else n
    expected = run(plain, input_ids=ids, labels=labels, num_items_in_batch=n)
    got = run(chunked, input_ids=ids, labels=labels, num_items_in_batch=n)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))
    mean = run(plain, backward=False, input_ids=ids, labels=labels).loss
    assert abs(expected.loss.item() - mean.item()) > 1e-3  # the reduction did change


@pytest.mark.parametrize("trainer", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("arch", ("llama", "gpt2", "zoo"))
def test_accumulation_over_two_micro_batches(arch, trainer):
    """Two forward/backward passes into the same .grad: (loss / 2).backward() twice, or the
    Trainer's way (num_items_in_batch: the step's token count, each loss a share of it)."""
    if arch == "zoo" and trainer:
        pytest.skip("the package's own model takes no num_items_in_batch")
    model = zoo_model() if arch == "zoo" else hf_model(arch)
    plain, chunked = pair(model)
    first, second = tokens("cpu", seed=1), tokens("cpu", seed=2)
    micro = [(first, first), (second, padded(second))]
    kwargs, scale = {}, 0.5
    if trainer:
        kwargs = {"num_items_in_batch": sum(int((labels[:, 1:] != -100).sum())
                                            for _, labels in micro)}
        scale = 1.0
    losses = {}
    for side, m in (("plain", plain), ("chunked", chunked)):
        losses[side] = sum(run(m, scale=scale, input_ids=ids, labels=labels, **kwargs).loss
                           for ids, labels in micro)
    assert_close(losses["chunked"], losses["plain"], grads(chunked), grads(plain))


@pytest.mark.parametrize("arch", ("llama", "qwen2", "gpt2", "zoo"))
def test_tied_embeddings(arch):
    """The head's weight is the embedding's: its grads from the head and from the embedding
    lookup add up in the one .grad."""
    if arch == "zoo":
        from llama_zoo.torch_llama import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=True))
        embedding = model.model.embed_tokens
    else:
        model = hf_model(arch, tie=True)
        embedding = model.get_input_embeddings()
    head = model.lm_head
    assert head.weight is embedding.weight
    plain, chunked = pair(model)
    ids = tokens("cpu")
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


@pytest.mark.parametrize("arch", ("llama", "gpt2"))
def test_frozen_head(arch):
    """A head that does not train (requires_grad False; for GPT-2 the tied embedding with
    it) gets no grad, and the rest the same grads."""
    model = hf_model(arch)
    model.lm_head.weight.requires_grad_(False)
    plain, chunked = pair(model)
    ids = tokens("cpu")
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    assert chunked.lm_head.weight.grad is None
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_only_the_head_trains():
    """Hidden states that do not require grad (the base model frozen): only the head's grad."""
    model = hf_model("qwen2")
    for p in model.model.parameters():
        p.requires_grad_(False)
    plain, chunked = pair(model)
    ids = tokens("cpu")
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    assert chunked.lm_head.weight.grad is not None
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_head_with_bias():
    """A head with a bias (nn.Linear(bias=True)): its grad is summed over the chunks too."""
    model = hf_model("llama")
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_(0, 1)
    plain, chunked = pair(model)
    ids = tokens("cpu")
    labels = padded(ids)
    expected = run(plain, input_ids=ids, labels=labels)
    got = run(chunked, input_ids=ids, labels=labels)
    assert chunked.lm_head.bias.grad is not None
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_eval_under_no_grad():
    plain, chunked = pair(hf_model("mistral"))
    plain.eval()
    chunked.eval()
    ids = tokens("cpu")
    with torch.no_grad():
        expected = plain(input_ids=ids, labels=ids)
        got = chunked(input_ids=ids, labels=ids)
    assert not got.loss.requires_grad
    assert abs(got.loss.item() - expected.loss.item()) <= FP32_LOSS_RTOL * expected.loss.item()
    assert torch.allclose(got.logits, expected.logits, rtol=1e-6, atol=1e-6)
    assert not got.logits.requires_grad


def test_autocast():
    """An fp32 model under torch.autocast(bfloat16): the head's product in bf16 as autocast
    makes it, the grads back in fp32."""
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    outs = {}
    for side, m in (("plain", plain), ("chunked", chunked)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[side] = m(input_ids=ids, labels=ids)
        outs[side].loss.backward()
    assert_close(outs["chunked"].loss, outs["plain"].loss, grads(chunked), grads(plain),
                 torch.bfloat16)
    assert outs["chunked"].logits.dtype == outs["plain"].logits.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Every family by structure (issue 52 item 3): what each forward does between its head and its
# loss (soft-capping, a logit scale, the router's auxiliary loss) is followed as it runs, and
# the loss and grads are the model's own.

_FAMILY_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
_MOE = dict(num_experts_per_tok=2)
# name: (config class, model class, what differs from _FAMILY_COMMON); a name whose classes
# this transformers lacks is skipped.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # final_logit_softcapping
               dict(head_dim=16, final_logit_softcapping=3.0, sliding_window=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, final_logit_softcapping=3.0, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, **_MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, moe_intermediate_size=32, **_MOE)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, **_MOE)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, num_local_experts=4, sliding_window=8, **_MOE)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),  # logits * scale
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=4.0)),  # / scaling
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1,
                         moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, head_dim=8, **_MOE)),
}
ROUTED = ("mixtral", "qwen3_moe", "gpt_oss", "olmoe")


def family_model(name, dtype=torch.float32, seed=0, device="cpu", **extra):
    config_name, model_name, differs = FAMILIES[name]
    config_class = getattr(transformers, config_name, None)
    model_class = getattr(transformers, model_name, None)
    if config_class is None or model_class is None:
        pytest.skip("transformers %s has no %s" % (transformers.__version__, model_name))
    cfg = config_class(**{**_FAMILY_COMMON, **differs, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    return model.train().to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_by_structure(name, dtype, device):
    """Any *ForCausalLM whose head is a linear layer: the chunked loss and every grad are the
    model's own (padded labels: the counted tokens are not all of them), the head computing
    no token of the batch, and out.logits (read afterwards) the model's, soft-capped or scaled
    as it returns them."""
    model = family_model(name, dtype, device=device)
    assert cl.unsupported_reason(model) is None
    plain, chunked = pair(model)
    ids = tokens(device)
    labels = padded(ids)
    seen = head_shapes(chunked)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op fell back to the whole logits
        expected = run(plain, input_ids=ids, labels=labels)
        got = run(chunked, input_ids=ids, labels=labels)
    assert seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain), dtype,
                 label="%s %s %s" % (name, str(dtype)[6:], device))
    assert got.logits.dtype == expected.logits.dtype
    assert rel(got.logits, expected.logits) <= (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainer", [False, True], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("name", ROUTED)
def test_router_aux_loss(name, trainer, device):
    """output_router_logits=True: the model adds router_aux_loss_coef x its load-balancing
    loss (of the router logits, not the vocabulary's) to the chunked cross-entropy, as its
    own forward does; the total and every grad (the routers' included) are the model's."""
    model = family_model(name, device=device, output_router_logits=True,
                         router_aux_loss_coef=0.5)
    plain, chunked = pair(model)
    ids = tokens(device)
    labels = padded(ids)
    kwargs = {"num_items_in_batch": 57} if trainer else {}
    seen = head_shapes(chunked)
    expected = run(plain, input_ids=ids, labels=labels, **kwargs)
    got = run(chunked, input_ids=ids, labels=labels, **kwargs)
    assert seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain),
                 label="%s with the router's loss, %s" % (name, device))
    assert torch.allclose(got.aux_loss, expected.aux_loss, rtol=1e-6)
    # The auxiliary loss is in the total: without it the loss differs by 0.5 x aux_loss.
    ce = run(plain, backward=False, input_ids=ids, labels=labels, output_router_logits=False,
             **kwargs).loss
    assert abs(expected.loss.item() - ce.item() - 0.5 * expected.aux_loss.item()) <= 1e-5
    assert 0.5 * expected.aux_loss.item() > 1e-3
    routers = [n for n, g in grads(chunked).items() if g is not None and
               (n.endswith("mlp.gate.weight") or n.endswith("block_sparse_moe.gate.weight") or
                ".router." in n)]
    assert routers  # the routers train from the auxiliary loss too


def test_what_cannot_be_chunked_is_the_models_own():
    """A forward that does with its logits what the chunked loss cannot compute a chunk at a
    time (a z-loss's logsumexp over them, a shift of the logits instead of the labels): the
    whole logits are computed for that op (the model's own result), with a warning once."""
    import torch.nn.functional as F

    class ZLoss(transformers.LlamaForCausalLM):  # Bamba's z-loss, after the model's loss
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            z = out.logits.logsumexp(dim=-1).pow(2).mean()
            out.loss = out.loss + 1e-3 * z
            return out

    class ShiftedLogits(transformers.LlamaForCausalLM):  # CLVP's shift of the logits
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            logits = out.logits[..., :-1, :].float()
            out.loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       labels[..., 1:].reshape(-1))
            return out

    for cls in (ZLoss, ShiftedLogits):
        torch.manual_seed(0)
        model = cls(hf_model("llama").config)
        assert cl.unsupported_reason(model) is None
        plain, chunked = pair(model)
        ids = tokens("cpu")
        expected = run(plain, input_ids=ids, labels=ids)
        with pytest.warns(UserWarning, match="whole logits"):
            got = run(chunked, input_ids=ids, labels=ids)
        assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


# ---------------------------------------------------------------------------------------------
# What Hugging Face's loss takes.

def test_shift_labels_kwarg():
    """shift_labels=: already shifted labels, used as they are (labels then only say that a
    loss is wanted)."""
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    shift = torch.roll(padded(ids), -2, dims=1)  # not what the shift of `labels` would give
    expected = run(plain, input_ids=ids, labels=ids, shift_labels=shift)
    got = run(chunked, input_ids=ids, labels=ids, shift_labels=shift)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_ignore_index_kwarg():
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    labels = ids.clone()
    labels[:, :5] = 7  # token 7 is "ignored" in this call
    expected = run(plain, input_ids=ids, labels=labels, ignore_index=7)
    got = run(chunked, input_ids=ids, labels=labels, ignore_index=7)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


@pytest.mark.parametrize("keep", [4, "positions"])
def test_logits_to_keep(keep):
    """logits_to_keep with labels for the kept positions: the loss over those, the logits of
    those; labels for the whole sequence with fewer kept positions fail on both sides."""
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    if keep == "positions":
        keep = torch.tensor([0, 3, 4, 9, 12])
        labels = ids[:, keep]
    else:
        labels = ids[:, -keep:]
    expected = run(plain, input_ids=ids, labels=labels, logits_to_keep=keep)
    got = run(chunked, input_ids=ids, labels=labels, logits_to_keep=keep)
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))
    assert got.logits.shape == expected.logits.shape
    assert torch.allclose(got.logits, expected.logits, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        plain(input_ids=ids, labels=ids, logits_to_keep=keep)
    with pytest.raises(ValueError, match="logits_to_keep"):
        chunked(input_ids=ids, labels=ids, logits_to_keep=keep)
    # A failed call leaves the model as it was: the next one is chunked again.
    seen = head_shapes(chunked)
    chunked(input_ids=ids, labels=ids)
    assert seen == [(BATCH, 0, VOCAB)]


def test_positional_labels():
    """The package's own model takes labels as its second positional argument."""
    plain, chunked = pair(zoo_model())
    ids = tokens("cpu")
    seen = head_shapes(chunked)
    expected = plain(ids, ids)
    expected.loss.backward()
    got = chunked(ids, ids)
    got.loss.backward()
    assert seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


# ---------------------------------------------------------------------------------------------
# .logits after labels.

def test_logits_every_way_they_are_read():
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    expected = plain(input_ids=ids, labels=ids)
    seen = head_shapes(chunked)
    got = chunked(input_ids=ids, labels=ids)
    # The loss, by name or attribute, and the keys read no logits.
    assert got["loss"] is got.loss and got.get("loss") is got.loss
    assert "logits" in got and list(got.keys()) == list(expected.keys())
    assert seen == [(BATCH, 0, VOCAB)]
    assert isinstance(got, type(expected))
    for read in (lambda o: o.logits, lambda o: o["logits"], lambda o: o[1],
                 lambda o: o.to_tuple()[1], lambda o: o.get("logits"),
                 lambda o: dict(o.items())["logits"]):
        fresh = chunked(input_ids=ids, labels=ids)
        logits = read(fresh)
        assert logits.shape == (BATCH, SEQ, VOCAB)
        assert torch.allclose(logits, expected.logits, rtol=1e-6, atol=1e-6)
        assert list(fresh.keys()) == list(expected.keys())
    # Pickling and copying give the model's own output class with the logits (outside the
    # graph: torch deep-copies graph leaves only).
    import pickle
    with torch.no_grad():
        again = pickle.loads(pickle.dumps(chunked(input_ids=ids, labels=ids)))
        copied = copy.deepcopy(chunked(input_ids=ids, labels=ids))
    assert type(again) is type(expected) and type(copied) is type(expected)
    assert torch.allclose(again.logits, expected.logits, rtol=1e-6, atol=1e-6)
    assert torch.allclose(copied.logits, expected.logits, rtol=1e-6, atol=1e-6)


def test_logits_are_attached_to_the_graph():
    """A loss that uses the logits read after labels trains as the plain model's does."""
    plain, chunked = pair(hf_model("gpt2"))
    ids = tokens("cpu")
    for m in (plain, chunked):
        out = m(input_ids=ids, labels=ids)
        (out.loss + 0.01 * out.logits.square().mean()).backward()
    for name, p in plain.named_parameters():
        assert rel(dict(chunked.named_parameters())[name].grad, p.grad) <= FP32_RTOL, name


def test_zoo_logits_after_labels():
    plain, chunked = pair(zoo_model())
    ids = tokens("cpu")
    expected = plain(ids, labels=ids)
    got = chunked(ids, labels=ids)
    assert torch.allclose(got.logits, expected.logits, rtol=1e-6, atol=1e-6)
    import dataclasses
    with torch.no_grad():  # asdict deep-copies: outside the graph
        fields = dataclasses.asdict(chunked(ids, labels=ids))
    assert torch.allclose(fields["logits"], expected.logits, rtol=1e-6, atol=1e-6)
    assert fields["loss"].item() == pytest.approx(expected.loss.item(), rel=FP32_LOSS_RTOL)


# ---------------------------------------------------------------------------------------------
# The opt-out, fallbacks and refusals.

def test_opt_out():
    """Not installed, disabled (handle.enabled = False) or uninstalled: the model's own path
    (the whole logits through the head), with the same loss."""
    model = hf_model("llama")
    ids = tokens("cpu")
    seen = head_shapes(model)
    reference = model(input_ids=ids, labels=ids).loss.item()
    assert seen[-1] == (BATCH, SEQ, VOCAB)
    handle = cl.install(model, chunk_tokens=CHUNK)
    assert cl.installed(model) is handle
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(reference, rel=1e-6)
    assert seen[-1] == (BATCH, 0, VOCAB)
    handle.enabled = False
    assert model(input_ids=ids, labels=ids).loss.item() == reference
    assert seen[-1] == (BATCH, SEQ, VOCAB)
    handle.enabled = True
    model(input_ids=ids, labels=ids)
    assert seen[-1] == (BATCH, 0, VOCAB)
    assert cl.uninstall(model) is True
    assert cl.installed(model) is None
    assert model(input_ids=ids, labels=ids).loss.item() == reference
    assert seen[-1] == (BATCH, SEQ, VOCAB)
    assert cl.uninstall(model) is False
    with pytest.raises(RuntimeError, match="already"):
        cl.install(model)
        cl.install(model)


def test_copied_model_and_resized_head():
    """copy.deepcopy of a model with the chunked loss: the copy computes it with its own
    head and parameters. resize_token_embeddings (a new head module): the loss follows it."""
    model = hf_model("llama")
    cl.install(model, chunk_tokens=CHUNK)
    twin = copy.deepcopy(model)
    assert cl.installed(twin) is not cl.installed(model) and cl.installed(twin).model is twin
    seen, twin_seen = head_shapes(model), head_shapes(twin)
    ids = tokens("cpu")
    run(twin, input_ids=ids, labels=ids)
    assert twin_seen == [(BATCH, 0, VOCAB)] and seen == []
    assert twin.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    plain = copy.deepcopy(model)
    cl.uninstall(plain)
    for m in (plain, model):
        m.resize_token_embeddings(VOCAB + 16)
    assert model.lm_head is not cl.installed(model).head  # a new module
    seen = head_shapes(model)
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(model, input_ids=ids, labels=ids)
    assert seen == [(BATCH, 0, VOCAB + 16)]
    assert_close(got.loss, expected.loss, grads(model), grads(plain))


def test_without_labels_nothing_changes():
    """Generation and plain forward passes: the head runs as always."""
    plain, chunked = pair(hf_model("qwen2"))
    ids = tokens("cpu")
    seen = head_shapes(chunked)
    assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert seen == [(BATCH, SEQ, VOCAB)]
    chunked.eval()
    plain.eval()
    out = chunked.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, plain.generate(ids[:1, :4], max_new_tokens=3, do_sample=False))


def test_return_dict_false_is_the_models_own_path():
    """return_dict=False asks for a tuple holding the whole logits: the model's own path
    computes it (documented fallback)."""
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    seen = head_shapes(chunked)
    expected = plain(input_ids=ids, labels=ids, return_dict=False)
    got = chunked(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(expected)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert seen == [(BATCH, SEQ, VOCAB)]


def test_custom_loss_function_is_the_models_own_path():
    """A loss function the user set on the model is theirs to compute: the model's path."""
    model = hf_model("llama")
    cl.install(model, chunk_tokens=CHUNK)
    seen = head_shapes(model)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    ids = tokens("cpu")
    out = model(input_ids=ids, labels=ids)
    assert seen == [(BATCH, SEQ, VOCAB)]
    assert torch.equal(out.loss, out.logits.float().mean())


def test_refusals():
    # A model without an output head, or whose forward takes no labels.
    assert "output head" in cl.unsupported_reason(torch.nn.Linear(4, 4))

    class NoLabels(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lm_head(x)

    assert "labels" in cl.unsupported_reason(NoLabels())
    with pytest.raises(ValueError, match="labels"):
        cl.install(NoLabels())
    # A head that is not a plain nn.Linear (a LoRA-style wrapper, a quantized layer).
    model = hf_model("llama")

    class Wrapped(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    old = model.lm_head
    model.lm_head = Wrapped(old.in_features, old.out_features, bias=False)
    with pytest.raises(ValueError, match="nn.Linear"):
        cl.install(model)
    model.lm_head = torch.nn.Sequential(old)
    with pytest.raises(ValueError, match="nn.Linear"):
        cl.install(model)
    # A loss function other than the causal LM's (a masked LM's).
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64))
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        cl.install(bert)
    assert cl.installed(bert) is None
    # Arguments.
    with pytest.raises(ValueError, match="chunk_tokens"):
        cl.install(hf_model("llama"), chunk_tokens=0)


def test_labels_refused_per_call():
    plain, chunked = pair(hf_model("llama"))
    ids = tokens("cpu")
    with pytest.raises(TypeError, match="integer"):
        chunked(input_ids=ids, labels=ids.float())
    with pytest.raises(ValueError):
        chunked(input_ids=ids, labels=ids[:, :5])
    # The model is usable afterwards, chunked.
    seen = head_shapes(chunked)
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    assert seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


def test_zoo_liger_mode_is_left_alone(monkeypatch):
    """The package's own model with loss_impl="liger" computes its own chunked loss (Liger's
    function, here a stand-in recording its call): left to it, labels and all."""
    import sys
    import types
    calls = []

    def fused(hidden, weight, labels, **kwargs):
        calls.append(labels)
        return hidden.sum() * 0

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = fused
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    model = zoo_model()
    cl.install(model, chunk_tokens=CHUNK)
    model.config.loss_impl = "liger"
    ids = tokens("cpu")
    out = model(ids, labels=ids)
    assert len(calls) == 1 and torch.equal(calls[0], ids[:, 1:].reshape(-1))
    assert out.loss.item() == 0.0


# ---------------------------------------------------------------------------------------------
# The function itself, and composition.

@pytest.mark.parametrize("chunk", [1, 7, 38, 39, 40, 1000])
def test_chunk_sizes(chunk):
    """Any chunk size gives the same loss and grads (1 token, uneven, the batch less one, the
    batch, more than the batch)."""
    torch.manual_seed(0)
    hidden = torch.randn(39, 64, requires_grad=True)
    weight = (torch.randn(VOCAB, 64) * 0.3).requires_grad_()
    bias = torch.randn(VOCAB, requires_grad=True)
    targets = torch.randint(0, VOCAB, (39,))
    targets[::5] = -100
    torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden, weight, bias).float(), targets).backward()
    expected = [t.grad.clone() for t in (hidden, weight, bias)]
    loss_expected = torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(hidden, weight, bias).float(), targets)
    for t in (hidden, weight, bias):
        t.grad = None
    loss = cl.linear_cross_entropy(hidden, weight, bias, targets, chunk_tokens=chunk)
    loss.backward()
    assert abs(loss.item() - loss_expected.item()) <= FP32_LOSS_RTOL * loss_expected.item()
    for t, e in zip((hidden, weight, bias), expected):
        assert rel(t.grad, e) <= FP32_RTOL


def test_backward_scales_and_retains():
    """The grads computed in the forward pass are scaled by the incoming grad, and a second
    backward through a retained graph gives them again."""
    torch.manual_seed(0)
    hidden = torch.randn(20, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    loss = cl.linear_cross_entropy(hidden, weight, None, targets, chunk_tokens=6)
    (loss * 3).backward(retain_graph=True)
    first = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (loss * 3).backward()
    assert torch.equal(hidden.grad, first[0]) and torch.equal(weight.grad, first[1])
    hidden.grad = weight.grad = None
    torch.nn.functional.cross_entropy(hidden @ weight.t(), targets).mul(3).backward()
    assert rel(first[0], hidden.grad) <= FP32_RTOL and rel(first[1], weight.grad) <= FP32_RTOL


def test_default_chunk_tokens():
    """The fp32 logits of a chunk within 1 GiB (the library's step plan's chunk)."""
    assert cl.default_chunk_tokens(128256) * 128256 * 4 <= 1 << 30
    assert (cl.default_chunk_tokens(128256) + 8) * 128256 * 4 > 1 << 30
    assert cl.default_chunk_tokens(32000) == 8384
    assert cl.default_chunk_tokens(10 ** 9) == 1
    model = hf_model("llama")
    assert cl.install(model).chunk_tokens == cl.default_chunk_tokens(VOCAB)


def test_forward_wrapped_and_hooked():
    """A model whose forward is wrapped as strata.torch.offload wraps it (an instance
    attribute calling the original, _note_memory_errors) and which has forward pre-hooks of
    its own (_ModelForwardBegins): the chunked loss still applies, whichever was first."""
    plain, chunked = pair(hf_model("llama"))
    calls = []
    chunked.register_forward_pre_hook(lambda m, args: calls.append("pre"))
    run_ = chunked.forward

    def forward(*args, **kwargs):
        calls.append("forward")
        return run_(*args, **kwargs)

    chunked.forward = forward
    seen = head_shapes(chunked)
    ids = tokens("cpu")
    expected = run(plain, input_ids=ids, labels=ids)
    got = run(chunked, input_ids=ids, labels=ids)
    assert calls == ["pre", "forward"] and seen == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(chunked), grads(plain))


@pytest.mark.parametrize("resident", [0, 1])
def test_composes_with_offload(resident, offload):
    """strata.torch.offload(chunked_loss=CHUNK): the loss of each training step as plain PyTorch's
    (streamed blocks, the resident head and embedding trained by st.AdamW)."""
    import strata.torch as st
    base = hf_model("llama")
    data = [tokens(tpm.DEVICE, seed=s) for s in (1, 2, 1)]
    plain = copy.deepcopy(base).to(tpm.DEVICE)
    expected, _ = tpm.train(plain, tpm.plain_adamw(plain.parameters()), data)
    model = offload(copy.deepcopy(base), resident_blocks=resident, chunked_loss=CHUNK)
    assert model.strata.chunked_loss is cl.installed(model) and not model.strata.chunked_loss.auto
    seen = head_shapes(model)
    opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
    got, _ = tpm.train(model, opt, data)
    tpm.synchronize(opt)
    assert seen == [(BATCH, 0, VOCAB)] * len(data)
    tpm.assert_losses_close(got, expected, rtol=1e-5)


def test_auto_chunks_only_calls_larger_than_a_chunk():
    """install(auto=True) (offload's default): a call whose labels fit one chunk computes the
    model's own loss (the head sees every token, and the result is bit for bit the model's),
    a larger one is chunked (the head sees none)."""
    plain = hf_model("llama")
    model = copy.deepcopy(plain)
    cl.install(model, chunk_tokens=CHUNK, auto=True)
    seen = head_shapes(model)
    small = tokens("cpu", batch=1, seq=CHUNK)
    got, expected = run(model, input_ids=small, labels=small), run(plain, input_ids=small,
                                                                   labels=small)
    assert seen == [(1, CHUNK, VOCAB)]
    assert torch.equal(got.loss, expected.loss)
    assert all(torch.equal(g, grads(plain)[n]) for n, g in grads(model).items())
    model.zero_grad()
    plain.zero_grad()
    ids = tokens("cpu")
    got, expected = run(model, input_ids=ids, labels=ids), run(plain, input_ids=ids, labels=ids)
    assert seen[1:] == [(BATCH, 0, VOCAB)]
    assert_close(got.loss, expected.loss, grads(model), grads(plain))


def test_offload_option(offload):
    """offload(chunked_loss=): the default installs it (auto) on a supported model; False
    leaves the model's own loss; True or a count on an unsupported model, or a bad value, is
    refused before anything changes; the default on an unsupported model with an output head
    warns; a user's own install is kept."""
    model = offload(hf_model("llama"))
    handle = model.strata.chunked_loss
    assert handle is cl.installed(model) and handle.auto
    assert handle.chunk_tokens == cl.default_chunk_tokens(VOCAB)
    model = offload(hf_model("llama"), chunked_loss=False)
    assert model.strata.chunked_loss is None and cl.installed(model) is None
    mine = hf_model("llama")
    handle = cl.install(mine, chunk_tokens=5)
    assert offload(mine).strata.chunked_loss is handle
    for bad in ("yes", 0, -3, 2.5):
        fresh = hf_model("llama")
        with pytest.raises(ValueError, match="chunk"):
            offload(fresh, chunked_loss=bad)
        assert getattr(fresh, "strata", None) is None and cl.installed(fresh) is None
    wrapped = hf_model("llama")  # a head that is not a plain nn.Linear (a LoRA-style one)
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    for required in (True, 16):
        with pytest.raises(ValueError, match="nothing was changed"):
            offload(copy.deepcopy(wrapped), chunked_loss=required)
    with pytest.warns(UserWarning, match="chunked_loss=False"):
        model = offload(copy.deepcopy(wrapped))
    assert model.strata.chunked_loss is None


# ---------------------------------------------------------------------------------------------
# Memory, on the GPU.

@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU")
def test_peak_memory_below_the_whole_logits():
    """Forward and backward with labels never hold the batch's logits: the peak allocated
    stays below what the fp32 logits alone would take (the model's own path goes above)."""
    vocab, batch, seq = 32768, 16, 256  # short rows: attention's memory stays small
    cfg = tpm.config("llama")
    cfg.vocab_size = vocab
    cfg.max_position_embeddings = seq
    torch.manual_seed(0)
    model = tpm.model_class("llama")(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), device="cuda")
    whole_fp32 = batch * seq * vocab * 4  # 512 MiB

    def peak(m):
        """(peak bytes over the start, loss, grads) of one forward and backward pass."""
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, loss.detach(), grads(m)

    own, own_loss, own_grads = peak(model)
    cl.install(model, chunk_tokens=512)  # 8 chunks; the fp32 logits of one: 64 MiB
    chunked, loss, chunked_grads = peak(model)
    print("\npeak allocated over forward+backward: model's own loss %.0f MiB, chunked %.0f MiB "
          "(the whole fp32 logits: %.0f MiB)" % (own / 2**20, chunked / 2**20, whole_fp32 / 2**20))
    assert own > whole_fp32, own
    assert chunked < whole_fp32 // 2, (chunked, whole_fp32)
    # At this size (4096 tokens, vocabulary 32768), the GPU's bf16 products: the tolerance.
    assert_close(loss, own_loss, chunked_grads, own_grads, torch.bfloat16,
                 label="llama bf16 cuda, 4096 tokens, vocabulary 32768")
