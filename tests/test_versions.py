"""The supported JAX range, and deprecations raised by commopt's own code."""

import pathlib
import subprocess
import sys
import tomllib
import warnings

import jax
import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]


def requirement(name):
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  return next(Requirement(d) for d in deps if Requirement(d).name == name)


def test_the_installed_jax_is_in_the_stated_range():
  spec = requirement("jax").specifier
  assert spec.contains(jax.__version__), (jax.__version__, str(spec))
  assert any(s.operator == "<" for s in spec), f"no upper bound on jax: {spec}"


def test_importing_commopt_raises_no_deprecation():
  code = ("import commopt, commopt.testing, commopt.wire, commopt.kernels, commopt.aggregators\n"
          "commopt.nnx_data_parallel")   # imports flax
  out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-W", "error::FutureWarning",
                        "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]


def test_a_deprecation_raised_from_commopt_code_fails_the_suite():
  """pyproject's filterwarnings turn them into errors for commopt's modules, not for others."""
  probe = "import warnings\nwarnings.warn('old spelling', {})"
  with pytest.raises(DeprecationWarning, match="old spelling"):
    exec(probe.format("DeprecationWarning"), {"__name__": "commopt._probe"})
  with pytest.raises(FutureWarning, match="old spelling"):
    exec(probe.format("FutureWarning"), {"__name__": "commopt.parallel._probe"})
  with warnings.catch_warnings(record=True):
    exec(probe.format("DeprecationWarning"), {"__name__": "somebody_else"})
