"""A compressor added from outside the package: one short file, one registration, the suite."""

import importlib.util
import pathlib

import pytest

import commopt
from commopt.testing import checks

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_compressor.py"


def load():
  spec = importlib.util.spec_from_file_location("custom_compressor", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_a_new_compressor_is_one_short_file_and_one_registration(mesh, mesh2d):
  lines = EXAMPLE.read_text().splitlines()
  assert len(lines) < 50
  assert sum("compressors.register(" in line for line in lines) == 1
  load()
  try:
    compressor = commopt.compressors.make("int8_scaled")
    ran = checks.run_all(compressor, mesh, mesh2d)
    # A stateless per-leaf compressor gets every check, the chunked strategies
    # and the robust rules included.
    assert {"chunked_strategies", "robust_rule_compatible",
            "payload_bytes_equal_hlo_audit"} <= set(ran)
  finally:
    commopt.compressors.unregister("int8_scaled")


def test_the_suite_catches_a_compressor_whose_bytes_are_misstated(mesh):
  module = load()
  try:
    honest = module.int8_scaled()
    lying = commopt.Compressor(name="lying", init=honest.init, encode=honest.encode,
                               decode=honest.decode, payload_bits=lambda shape, dtype: 8)
    try:
      checks.payload_bytes_equal_hlo_audit(lying, mesh)
    except AssertionError as e:
      assert "payload_bytes says" in str(e)
    else:
      raise AssertionError("the audit check passed a compressor that misstates its bytes")
  finally:
    commopt.compressors.unregister("int8_scaled")
