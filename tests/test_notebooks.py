"""Every notebook in examples/notebooks runs top to bottom (small mode) and is a jupytext notebook.

The notebooks that train run in the slow tier (CI runs both tiers); the
wire notebook only traces shapes and runs in the default tier.
"""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples" / "notebooks").glob("*.py"))
QUICK = {"wire_architectures"}


def test_there_are_notebooks():
  assert {"tour", "convergence_bytes", "when_compression_pays", "wire_architectures"} <= {
      p.stem for p in NOTEBOOKS}


@pytest.mark.slow
@pytest.mark.parametrize("path", [
    p if p.stem in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in NOTEBOOKS],
    ids=lambda p: p.stem)
def test_notebook_runs_in_small_mode(path, tmp_path):
  jupytext = pytest.importorskip("jupytext")
  notebook = jupytext.read(path)
  kinds = {c.cell_type for c in notebook.cells}
  assert kinds == {"markdown", "code"}, kinds          # percent format: prose and code cells
  env = dict(os.environ, COMMOPT_NOTEBOOK_SMALL="1", COMMOPT_NOTEBOOK_OUT=str(tmp_path))
  proc = subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  written = list(tmp_path.glob("*.png"))
  assert written and all(p.stat().st_size > 10_000 for p in written), written
