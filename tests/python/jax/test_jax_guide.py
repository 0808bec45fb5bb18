"""docs/python-guide.md's JAX quick start runs as pasted (a new user's review found it could
not: it named functions it never defined)."""
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

GUIDE = pathlib.Path(__file__).resolve().parents[3] / "docs" / "python-guide.md"


def quick_start():
    text = GUIDE.read_text()
    section = text[text.index("## JAX quick start"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```\n", start)]


def test_the_jax_quick_start_runs_as_pasted(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(done.stdout.strip().splitlines()[-1])
    assert 0 < loss < 5.0  # it learns (ln 256 = 5.55 at the start)
    assert (tmp_path / "ckpt").is_dir()
