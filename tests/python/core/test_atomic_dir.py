"""Checkpoints through the runtime's one atomic directory (strata.atomic_dir, strata.h "Atomic
directories"), for strata.torch (strata.jax's: test_jax_atomic_checkpoint.py): the bindings'
errors; a save that crashed
before its commit (its staging directory left behind) leaves the previous checkpoint to load,
and the next save clears the leftover; a save that crashed between the two renames of a file
system without renameat2(RENAME_EXCHANGE) (the previous checkpoint at "<path>.old", none at
<path>) loads from "<path>.old"."""
import os

import pytest

from strata import atomic_dir
from strata.errors import InvalidArgument, NotFound

from atomic_crash import crash_before_commit, crash_between_renames


def test_staging_begin_commit_resolve(tmp_path):
    path = tmp_path / "deep" / "ckpt"
    staging = atomic_dir.staging(str(path) + "//")
    assert staging == str(path) + ".partial" and not os.path.exists(staging)
    assert atomic_dir.begin(path) == staging and os.path.isdir(staging)
    (tmp_path / "deep" / "ckpt.partial" / "a").write_text("v1")
    atomic_dir.commit(path)
    assert (path / "a").read_text() == "v1" and not os.path.exists(staging)
    assert atomic_dir.resolve(path) == str(path)
    with pytest.raises(NotFound, match="staging directory"):
        atomic_dir.commit(path)  # nothing staged
    with pytest.raises(NotFound, match="does not exist"):
        atomic_dir.resolve(tmp_path / "none")
    (tmp_path / "file").write_text("x")
    for bad in ("", "/", str(tmp_path / "file")):
        with pytest.raises(InvalidArgument):
            atomic_dir.begin(bad)
    with pytest.raises(InvalidArgument, match="not a directory"):
        atomic_dir.resolve(tmp_path / "file")


@pytest.mark.parametrize("crash", [crash_before_commit, crash_between_renames])
def test_torch_load_after_a_crash_is_the_previous_checkpoint(crash, offload, tmp_path):
    pytest.importorskip("transformers")
    import strata.torch as st
    from torch_parity_models import (LR, WD, assert_state_close, batches, build, snapshot,
                                     synchronize, train)

    data = batches(2)
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    train(model, opt, data[:1])
    path = tmp_path / "ckpt"
    st.save_checkpoint(str(path), model, opt)
    synchronize(opt)
    saved = snapshot(model)
    train(model, opt, data[1:])
    synchronize(opt)
    crash(path)
    st.load_checkpoint(str(path), model, opt)
    assert_state_close(snapshot(model), saved, exact=True)
    st.save_checkpoint(str(path), model, opt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
