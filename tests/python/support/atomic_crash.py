"""Checkpoint saves that died midway (strata.atomic_dir's staging and renames), for the
crash tests of every binding."""
import os

from strata import atomic_dir


def crash_before_commit(path):
    """A save that died while writing: its staging directory, half written."""
    staging = atomic_dir.begin(path)
    with open(os.path.join(staging, "half-written"), "w") as f:
        f.write("junk")
    return staging


def crash_between_renames(path):
    """A save that died between the two renames: the previous checkpoint moved aside to
    "<path>.old", the new one still in staging."""
    staging = crash_before_commit(path)
    os.rename(path, str(path) + ".old")
    assert not os.path.exists(path) and os.path.isdir(staging)
