"""A vision-language model trained data parallel through strata.torch (2 ranks, gloo, the
CPU), the ranks' batches unlike: one rank's with an image, the other's text only, so the
resident vision tower has grads on one rank and none on the other. The ranks agree on which
resident parameters have grads before averaging them (strata.torch.layout.reduce), a rank
without one counting zeros as DDP does; before, each rank averaged only its own grads and the
collectives mismatched (gloo: "Received data size doesn't match expected size").

The oracle is plain PyTorch in one process on the mean of the two ranks' losses (DDP's
average of the ranks' grads): rank 0's losses within 1e-6 relative, every parameter within
1e-6, but for the attention key bias (torch_parity_models.KEY_BIAS_ATOL, its reason)."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)
pytest.importorskip("transformers")
import rank_launch  # noqa: E402
import torch_vlm_dist_worker as worker  # noqa: E402
import torch_vlm_models as vlm  # noqa: E402
from torch_parity_models import (  # noqa: E402
    LR, WD, assert_losses_close, assert_state_close, snapshot)

STEPS = 2


def plain_ddp(family):
    """One process on the mean of the ranks' losses: (rank 0's losses, the final state)."""
    torch.set_num_threads(1)
    model = vlm.build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ranks = [worker.rank_batches(family, r, STEPS) for r in range(2)]
    losses = []
    for first, second in zip(*ranks):
        mine, other = model(**first).loss, model(**second).loss
        ((mine + other) / 2).backward()
        opt.step()
        opt.zero_grad()
        losses.append(mine.item())
    return losses, snapshot(model)


def test_ranks_with_and_without_images_train_as_ddp(tmp_path):
    family = "qwen2_5_vl"
    out = tmp_path / "rank0.pt"
    argv = ["--world", "2", "--port", str(rank_launch.free_port()), "--family", family,
            "--steps", str(STEPS), "--out", str(out)]
    ctx = rank_launch.forkserver("torch", "torch.distributed", "torch._dynamo", "transformers",
                                 "strata.torch", "torch_vlm_models", "torch_vlm_dist_worker")
    codes, texts, _ = rank_launch.launch(ctx, worker.entry, argv, 2, str(tmp_path / "log"),
                                         240)
    assert codes == [0, 0], "exit codes %s\n%s" % (codes, "\n".join(
        "--- rank %d\n%s" % (r, text[-3000:]) for r, text in enumerate(texts)))
    got = torch.load(out)
    expected, expected_state = plain_ddp(family)
    assert_losses_close(got["losses"], expected)
    assert_state_close(got["state"], expected_state)
