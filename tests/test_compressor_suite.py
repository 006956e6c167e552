"""One suite, every registered compressor: the checks of :mod:`commopt.testing.checks`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import commopt
from commopt import wire
from commopt._src import base
from commopt.compressors import REGISTRY, VARIANTS, make
from commopt.testing import checks, convergence

NAMES = sorted(REGISTRY)
# Every registered compressor with its defaults, and each registered variant.
CASES = [(n, {}) for n in NAMES] + [(n, v) for n in NAMES for v in VARIANTS[n]]
IDS = [n + "".join(f"[{k}={v}]" for k, v in opts.items()) for n, opts in CASES]
# The same cases, each variant's compile-bound checks in the slow tier (the defaults keep
# them in the default tier).
TIERED = [pytest.param(n, opts, id=i, marks=pytest.mark.slow if opts else ())
          for (n, opts), i in zip(CASES, IDS)]
# A bf16 payload summed by the all-reduce rounds in a backend-specific order
# (XLA:CPU sums in f32, vmap in bf16); its residuals cannot see the rounding of
# the sum itself. Casts get a few bf16 ulps there.
BF16_SUM = {"cast"}
# Decoders ending in an inexact product (scale · level · 1/top): fused into the
# gathered sum, the compiler may contract it with the add (one FMA), a rounding
# the separate decode makes. Every other decoder's one-pass sum is bit-identical.
INEXACT_DECODE = {"qsgd", "int_quant"}
# Decoders built from an SVD: a last-bit change of the input (a running mean
# against a sum) moves the singular vectors by ~eps·‖M‖/gap, and the sent
# triples are scaled by 1/p (~120 here), so the output moves by ~1e-5 of its
# largest entry.
SVD_BASED = {"atomo"}


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_jit_without_retrace(name, opts):
  checks.jit_without_retrace(make(name, **opts))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_dtypes_and_none_leaves(name, dtype):
  checks.dtypes_and_none_leaves(make(name), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_vmap_workers_equal_shard_map_workers(name, opts, mesh):
  checks.vmap_equals_shard_map(make(name, **opts), mesh,
                               atol=3e-2 if name in BF16_SUM else 1e-6)


# The heaviest family of the suite (about 3 of the default tier's minutes on 2
# cores): it runs in the slow tier, which CI also runs.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_gathered_sum_in_one_pass_equals_decoding_each_payload(name, opts, dtype):
  c = make(name, **opts)
  if c.reduce is not None:
    pytest.skip(f"{c.name} runs its own protocol")
  checks.fused_sum_equals_reference(c, dtype=dtype, exact=name not in INEXACT_DECODE)


# The longest to compile (3-5 s each on 2 cores) in the slow tier.
ONE_DEVICE_SLOW = {"adaptive_levels", "atomo", "gradient_dropping", "sketch_sgd", "sketchml",
                   "terngrad", "variance_balanced"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ONE_DEVICE_SLOW else n for n in NAMES])
def test_one_device_shard_map_equals_local(name):
  checks.one_device_equals_local(make(name))


@pytest.mark.parametrize("name,opts", TIERED)
def test_error_feedback_conservation(name, opts, mesh):
  if make(name, **opts).error_kind == "direction":
    pytest.skip("sign keeps no residual: error feedback is refused for it")
  checks.error_feedback_conservation(make(name, **opts), mesh,
                                     atol=6e-2 if name in BF16_SUM else 1e-4)


@pytest.mark.parametrize("name,opts", TIERED)
def test_payload_bytes_equal_hlo_audit(name, opts, mesh):
  checks.payload_bytes_equal_hlo_audit(make(name, **opts), mesh)
  # XLA:CPU widens 16-bit all-reduces to f32 when it compiles (GPUs keep them);
  # the audit's stage="auto" then reads the wire format before that pass.
  if name == "cast" and not opts and jax.default_backend() == "cpu":
    sm = commopt.testing.shard_map_workers(
        commopt.compressed_mean(make(name), axis_name="data", min_size=checks.MIN_SIZE), mesh, "data")
    u, state = checks.worker_updates(40), sm.init(checks.params_like())
    compiled = wire.hlo_collectives(sm.update, u, state, stage="compiled")
    assert any("f32" in c.dtypes for c in compiled)
    assert any("bf16" in c.dtypes for c in wire.hlo_collectives(sm.update, u, state))
  if name not in ("identity", "cast") and not opts:
    report = wire.payload_bytes(make(name), checks.params_like(), min_size=checks.MIN_SIZE)
    assert report.ratio > 3   # int8 and natural (9 bits) are the least


@pytest.mark.parametrize("name,opts", CASES, ids=IDS)
def test_declared_capabilities_hold(name, opts):
  checks.declared_capabilities(make(name, **opts))


@pytest.mark.parametrize("name", NAMES)
def test_state_keeps_its_types_through_lax_cond(name):
  checks.cond_state_stability(make(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_applies_the_mean_of_the_accumulated_inputs(name):
  checks.multi_steps_accumulates(make(name), atol=2e-3 if name in SVD_BASED else 1e-6)


STATELESS = [n for n in NAMES if base.is_stateless_per_leaf(make(n))]
CHUNKED = [n for n in STATELESS if "flat_chunks" in make(n).capabilities]


@pytest.mark.slow
@pytest.mark.parametrize("name", CHUNKED)
def test_two_phase_and_hierarchical_conserve(name, mesh, mesh2d):
  if make(name).error_kind == "direction":
    pytest.skip("sign keeps no residual: error feedback is refused for it")
  checks.chunked_strategies(make(name), mesh, mesh2d, atol=6e-2 if name in BF16_SUM else 2e-4)


@pytest.mark.parametrize("name", STATELESS)
def test_robust_rules_decode_each_payload(name):
  checks.robust_rule_compatible(make(name))


def test_the_stateless_list_is_not_empty_and_excludes_protocols():
  assert "scaled_sign" in STATELESS and "power_sgd" not in STATELESS
  assert "atomo" in STATELESS and "atomo" not in CHUNKED and "scaled_sign" in CHUNKED


@pytest.mark.parametrize("name", NAMES)
def test_options_of_the_wrong_type_are_refused(name):
  checked = checks.option_types(name)
  typed = [o for o in commopt.compressors.options(name) if o not in ("view", "value_dtype")]
  assert checked == typed


# --- Every default trains: bounded residuals, convergence on a strongly convex problem ---
# Strom's threshold is absolute: its residual stays bounded only while the input's
# mean magnitude is below capacity·tau (its docstring), which the registered
# tau=1e-3 is not for these unit-scale inputs; it runs at an operating point.
OPERATING_POINT = {"threshold": {"tau": 4.0, "capacity": 0.25}}
# The stated factors over plain SGD's noise floor (lr·L = 0.15, 4 workers, 500
# steps; convergence.quadratic_gap). 3 unless listed. The slow ones send about
# k of n coordinates per step with no residual (random-k, variance-balanced,
# SketchSGD's heavy hitters at 1%): each coordinate moves on about k/n of the
# steps, so in 500 steps they are still on their way down (halfway or better).
GAP = {"atomo": 8.0, "count_sketch": 4.0, "threshold": 4.0, "sign": 6.0, "random_k": 150.0,
       "variance_balanced": 200.0, "sketch_sgd": 120.0}
SLOW_DESCENT = {"random_k", "variance_balanced", "sketch_sgd"}


def _at_defaults(name):
  return make(name, **OPERATING_POINT.get(name, {}))


@pytest.mark.slow
@pytest.mark.parametrize("gradients", ["constant", "random"])
@pytest.mark.parametrize("name", NAMES)
def test_the_default_residual_stays_bounded(name, gradients):
  """500 steps on 4 workers: ‖e‖/‖g‖ within the declared contraction's bound (2/δ), and
  for compressors that declare none, under 100 and growing more slowly than √t over the
  second half (a residual that grows linearly doubles; AdaComp's grows by about 1.3)."""
  c = _at_defaults(name)
  growth = convergence.residual_growth(c, gradients)
  assert np.all(np.isfinite(growth.ratios)), f"{c.name}: non-finite residual"
  if not growth.kept:
    assert c.error_kind not in ("contractive", "biased"), f"{c.name} keeps no residual"
    return
  worst = float(growth.ratios.max())
  assert worst <= growth.bound, f"{c.name}: residual {worst:.3g}·‖g‖ above {growth.bound:.3g}"
  first, second = growth.ratios[:250].max(), growth.ratios[250:].max()
  if c.error_kind == "biased":
    assert second <= 1.4 * first + 1e-6, (
        f"{c.name}: residual still growing, {first:.3g} then {second:.3g}·‖g‖")
    assert worst <= 100, f"{c.name}: residual {worst:.3g}·‖g‖"


@pytest.mark.parametrize("name", [n for n in NAMES if make(n).error_kind == "unbiased"])
def test_explicit_error_feedback_on_an_unbiased_compressor_keeps_a_bounded_residual(name):
  """error_feedback=True runs C/(1+ω), a contraction: bounded where C's own residual grows."""
  c = make(name)
  growth = convergence.residual_growth(c, "constant", error_feedback=True)
  assert growth.kept and np.isfinite(growth.bound)
  assert float(growth.ratios.max()) <= growth.bound


def test_error_feedback_true_on_sign_says_what_to_use():
  with pytest.raises(ValueError, match="scaled_sign"):
    commopt.compressed_mean(commopt.sign(), error_feedback=True)
  with pytest.raises(TypeError, match="error_feedback"):
    commopt.compressed_mean(commopt.top_k(0.1), error_feedback="no")


def test_every_registered_compressor_declares_its_error():
  """Each registered default declares a kind; the bounded kinds give δ in (0, 1]."""
  for name in NAMES:
    c = make(name)
    assert c.error_kind in base.ERROR_KINDS and c.error_kind in c.capabilities
    if c.delta(convergence.SHAPE) is not None:
      assert 0 < c.delta(convergence.SHAPE) <= 1, name
  undeclared = sorted(n for n in NAMES if make(n).error_kind == "biased")
  assert undeclared == ["adacomp", "gradient_dropping", "power_sgd", "sketchml", "threshold"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_defaults_converge_on_a_noisy_strongly_convex_problem(name):
  """lr·L = 0.15, 4 workers, 500 steps: finite, descending, within the stated factor of SGD."""
  c = _at_defaults(name)
  gap = convergence.quadratic_gap(c)
  assert np.isfinite(gap.final), f"{c.name}: diverged"
  assert gap.final <= (0.5 if name in SLOW_DESCENT else 0.05) * gap.initial, (
      f"{c.name}: loss {gap.initial:.3g} -> {gap.final:.3g}")
  assert gap.ratio <= GAP.get(name, 3.0), f"{c.name}: {gap.ratio:.3g}× plain SGD's floor"
