"""strata.jax's checkpoints in the runtime's atomic directory (strata.atomic_dir): a save that
crashed before its commit, or between the two renames of a file system without
renameat2(RENAME_EXCHANGE) (the previous checkpoint at "<path>.old"), leaves the previous
checkpoint to load, whole; the next save clears what the crash left."""
import os

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

import jax_parity_models as api  # noqa: E402
from atomic_crash import crash_before_commit, crash_between_renames  # noqa: E402


@pytest.mark.parametrize("crash", [crash_before_commit, crash_between_renames])
def test_jax_load_after_a_crash_is_the_previous_checkpoint(crash, tmp_path):
    blocks, residents = api.mlp_params()
    data = api.mlp_data(3)
    path = tmp_path / "ckpt"
    with api.mlp_trainer(blocks, residents) as trainer:
        trainer.step(data[0])
        trainer.save(path)
        saved_blocks, saved_residents = trainer.get_params(masters=True)
        trainer.step(data[1])  # moves on after the checkpoint
        crash(path)
        trainer.load(path)
        assert trainer.step_count == 1
        got_blocks, got_residents = trainer.get_params(masters=True)
        api.assert_close(saved_blocks, got_blocks, rtol=0, what="blocks")
        api.assert_close(saved_residents, got_residents, rtol=0, what="residents")
        trainer.save(path)  # clears what the crash left
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]
