"""A mixture of experts' checkpoint through st.offload(weights=), on the CPU: transformers'
save_pretrained writes one tensor per expert (`mlp.experts.0.gate_proj.weight`, as the Hub's
MoE checkpoints do) where the model has fused 3-D parameters (`mlp.experts.gate_up_proj`);
from_pretrained converts them through its conversion mapping, and so must the streamed
loader (a user review found Qwen3-MoE refused: "missing 4: model.layers.0.mlp.experts.
gate_up_proj, ..."). The oracle is from_pretrained on the same directory: every parameter and
one training step's loss equal, exactly. Every family of moe_models, whichever layout its
save_pretrained writes (GPT-OSS's is already fused), and a fused checkpoint
(safetensors.torch.save_file of the model's state_dict) keeps loading."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402
from strata.torch._weights import WeightsError  # noqa: E402

from moe_models import FAMILIES, moe_model  # noqa: E402
from torch_parity_models import (  # noqa: E402
    DEVICE, assert_state_close, batches, plain_adamw, snapshot, synchronize)

transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def saved(name, directory, fused=False, **extra):
    """A tiny model of family `name` (`extra`: its config's overrides) saved in `directory` by
    save_pretrained (the Hub's layout), or with its state_dict as it is (fused=True): the saved
    model's config."""
    from safetensors.torch import save_file
    base = moe_model(name, **extra)
    base.save_pretrained(str(directory))
    if fused:
        save_file({k: v.contiguous() for k, v in base.state_dict().items()},
                  str(directory / "model.safetensors"), metadata={"format": "pt"})
    return base.config


def file_keys(directory):
    from safetensors import safe_open
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def on_meta(config):
    model_class = getattr(transformers, FAMILIES[config.model_type][1])
    with torch.device("meta"):
        return model_class(config).train()


def one_step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("fused", [False, True], ids=["save_pretrained", "state_dict"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_moe_checkpoint_loads_as_from_pretrained_loads_it(name, fused, offload, tmp_path):
    """The streamed loader gives every parameter from_pretrained gives, and the first training
    step's loss is the same, to the bit."""
    config = saved(name, tmp_path, fused)
    per_expert = any(".experts.0." in k for k in file_keys(tmp_path))
    # save_pretrained writes per-expert tensors for every family but GPT-OSS (whose Hub
    # checkpoints are fused); the state_dict is the model's own, fused, layout.
    assert per_expert == (not fused and name != "gpt_oss")
    reference = getattr(transformers, FAMILIES[name][1]).from_pretrained(
        str(tmp_path), attn_implementation="eager").train().to(DEVICE)
    model = offload(on_meta(config), weights=str(tmp_path), chunked_loss=False)
    opt = st.AdamW(model.parameters(), lr=plain_adamw([torch.zeros(1)]).defaults["lr"],
                   weight_decay=plain_adamw([torch.zeros(1)]).defaults["weight_decay"])
    assert_state_close(snapshot(model), snapshot(reference), exact=True)
    ids = batches(1)[0]
    got = one_step(model, opt, ids)
    synchronize(opt)
    expected = one_step(reference, plain_adamw(reference.parameters()), ids)
    assert got == expected


def test_a_checkpoint_missing_an_expert_is_refused_by_name(offload, tmp_path):
    """A per-expert checkpoint with one expert's tensors gone: its fused parameter comes out
    with one expert fewer, refused with the names and shapes, nothing changed."""
    from safetensors.torch import load_file, save_file
    config = saved("qwen3_moe", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gone = [k for k in tensors if k.startswith("model.layers.1.mlp.experts.3.")]
    assert gone
    save_file({k: v for k, v in tensors.items() if k not in gone},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    meta = on_meta(config)
    with pytest.raises(WeightsError, match=r"shapes differ: model\.layers\.1\.mlp\.experts\."
                                           r"(gate_up_proj|down_proj): \[3, "):
        offload(meta, weights=str(tmp_path))
    assert all(p.is_meta for p in meta.parameters())


def test_experts_fuse_in_their_numeric_order(offload, tmp_path):
    """12 experts: expert 10 goes after expert 9 (from_pretrained's natural order of the keys),
    not after expert 1 as the file's sorted keys list it."""
    config = saved("qwen3_moe", tmp_path, num_experts=12)
    assert "model.layers.0.mlp.experts.10.down_proj.weight" in file_keys(tmp_path)
    reference = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).to(DEVICE)
    model = offload(on_meta(config), weights=str(tmp_path), chunked_loss=False)
    st.AdamW(model.parameters(), lr=1e-3)
    assert_state_close(snapshot(model), snapshot(reference), exact=True)
