"""Hugging Face's safetensors reads a checkpoint Strata wrote (strata_optimizer_tests writes it
where STRATA_CHECKPOINT_DIR says): names, dtypes, shapes, values, and the metadata transformers
looks for."""
import os
import pathlib

import pytest

safetensors = pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")

CKPT = pathlib.Path(os.environ.get("STRATA_CHECKPOINT_DIR", ""))


@pytest.fixture(scope="module")
def ckpt():
    if not (CKPT / "model.safetensors").exists():
        pytest.fail("STRATA_CHECKPOINT_DIR must name the checkpoint strata_optimizer_tests wrote")
    return CKPT


def test_weights_read_with_their_names_dtypes_and_shapes(ckpt):
    with safetensors.safe_open(str(ckpt / "model.safetensors"), framework="np") as f:
        assert sorted(f.keys()) == ["embed", "layers.0.w"]
        assert f.metadata()["format"] == "pt"
        np.testing.assert_array_equal(f.get_tensor("embed"),
                                      np.arange(6, dtype=np.float32).reshape(2, 3))
        bf16 = f.get_slice("layers.0.w")
        assert bf16.get_dtype() == "BF16"
        assert bf16.get_shape() == [4]


def test_bf16_values_and_optimizer_state_through_torch(ckpt):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    model = load_file(str(ckpt / "model.safetensors"))
    assert model["layers.0.w"].dtype == torch.bfloat16
    torch.testing.assert_close(model["layers.0.w"].float(), torch.tensor([0.5, 1.5, 2.5, 3.5]))
    state = load_file(str(ckpt / "optimizer.safetensors"))
    assert sorted(state) == ["layers.0.w.master"]
    torch.testing.assert_close(state["layers.0.w.master"], torch.tensor([0.5, 1.5, 2.5, 3.5]))


def test_optimizer_metadata(ckpt):
    with safetensors.safe_open(str(ckpt / "optimizer.safetensors"), framework="np") as f:
        meta = f.metadata()
    assert meta["optimizer"] == "sgd"
    assert meta["step"] == "1"
    assert all(k.startswith("crc32c.") or k in
               {"strata.checkpoint", "optimizer", "step", "skipped_steps", "growth_tracker",
                "loss_scale", "loss_scale_bits"} for k in meta)
