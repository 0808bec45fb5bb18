"""Flax and Equinox are optional extras of strata.jax: without them (their imports made to
fail in a fresh interpreter) `import strata.jax` works, and strata.jax.offload of something
that is no framework's module says what it takes. Runs without Flax and Equinox installed."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

SCRIPT = """
import sys
sys.modules["flax"] = sys.modules["flax.nnx"] = sys.modules["equinox"] = None  # import fails
import strata.jax as sj
assert "flax.nnx" not in sys.modules or sys.modules["flax.nnx"] is None
try:
    sj.offload(object())
except TypeError as e:
    print(e)
"""


def test_strata_jax_imports_without_flax_or_equinox():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not a Flax NNX module (flax.nnx.Module) nor an Equinox module" in out.stdout
