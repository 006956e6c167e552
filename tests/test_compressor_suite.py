"""One suite, every registered compressor: the checks of :mod:`commopt.testing.checks`."""

import pathlib

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
# Each compressor runs at make(name), the registry's defaults, and nothing else.

# The factor over plain SGD's noise floor (lr·L = 0.15, 4 workers, 500 steps;
# convergence.quadratic_gap) each registered default is held to: DEFAULT_GAP unless listed.
# docs/guide/guarantees.md states the same factors (test_the_guarantees_page_states_...).
# The slow ones send about k of n coordinates per step drawn whatever the magnitudes, with no
# residual (random-k, variance-balanced, SketchSGD's heavy hitters at 1%, which on this
# noise-dominated leaf are not heavy): each coordinate moves on about k/n of the steps, so in
# 500 steps they are still on their way down (halfway or better).
DEFAULT_GAP = 3.0
GAP = {"atomo": 8.0, "count_sketch": 4.0, "sign": 6.0, "random_k": 150.0,
       "variance_balanced": 200.0, "sketch_sgd": 120.0}
SLOW_DESCENT = {"random_k", "variance_balanced", "sketch_sgd"}
# What brings the slow ones to SGD's rate: error feedback (a residual of C, of C/(1+ω) for the
# unbiased variance_balanced), at a step size the residual's delay of about n/k steps allows,
# lr·L ≲ δ ≈ k/n (3/256 on the 16×16 leaf): against plain SGD at the same step size, over
# SGD_RATE["steps"], within SGD_RATE_GAP. At lr·L = 0.15 the same option stays further than
# that (random_k and sketch_sgd diverge).
SGD_RATE = {"error_feedback": True, "lr": 0.01, "steps": 2000}
SGD_RATE_GAP = 3.0


def gap_factor(name):
  return GAP.get(name, DEFAULT_GAP)


@pytest.mark.slow
@pytest.mark.parametrize("gradients", ["constant", "random"])
@pytest.mark.parametrize("name", NAMES)
def test_the_default_residual_stays_bounded(name, gradients):
  """500 steps on 4 workers: ‖e‖/‖g‖ within the declared contraction's bound (2/δ) and
  under 100, and for compressors that declare none, growing more slowly than √t over the
  second half (a residual that grows linearly doubles; AdaComp's grows by about 1.3)."""
  c = make(name)
  growth = convergence.residual_growth(c, gradients)
  assert np.all(np.isfinite(growth.ratios)), f"{c.name}: non-finite residual"
  if not growth.kept:
    assert c.error_kind not in ("contractive", "biased"), f"{c.name} keeps no residual"
    return
  worst = float(growth.ratios.max())
  assert worst <= growth.bound, f"{c.name}: residual {worst:.3g}·‖g‖ above {growth.bound:.3g}"
  assert worst <= 100, f"{c.name}: residual {worst:.3g}·‖g‖"
  first, second = growth.ratios[:250].max(), growth.ratios[250:].max()
  if c.error_kind == "biased":
    assert second <= 1.4 * first + 1e-6, (
        f"{c.name}: residual still growing, {first:.3g} then {second:.3g}·‖g‖")


@pytest.mark.parametrize("name", [n for n in NAMES if make(n).error_kind == "contractive"])
def test_declared_contractions_hold(name):
  """‖x − C(x)‖² ≤ (1 − δ)‖x‖² at the declared δ, on normal, heavy-tailed, flat and
  one-spike inputs (what error feedback's bound rests on)."""
  c = make(name)
  shape = (64, 64)
  delta = c.delta(shape)
  key = jax.random.key(0)
  inputs = {"normal": jax.random.normal(key, shape), "cauchy": jax.random.cauchy(key, shape),
            "flat": jnp.full(shape, -0.5), "spike": jnp.zeros(shape).at[3, 7].set(2.0)}
  roundtrip = jax.jit(lambda x: c.decode(c.encode(x, c.init(x), key)[0], c.init(x), x))
  for what, x in inputs.items():
    err = float(jnp.sum(jnp.square(x - roundtrip(x))))
    norm = float(jnp.sum(jnp.square(x)))
    assert err <= (1 - delta) * norm * (1 + 1e-5), (
        f"{c.name} on {what} input: ‖x − C(x)‖² = {err:.6g} > (1 − δ)‖x‖² = "
        f"{(1 - delta) * norm:.6g}, δ = {delta:.3g}")


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
  assert undeclared == ["adacomp", "gradient_dropping", "power_sgd", "sketchml"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_defaults_converge_on_a_noisy_strongly_convex_problem(name):
  """lr·L = 0.15, 4 workers, 500 steps: finite, descending, within the stated factor of SGD."""
  c = make(name)
  gap = convergence.quadratic_gap(c)
  assert np.isfinite(gap.final), f"{c.name}: diverged"
  assert gap.final <= (0.5 if name in SLOW_DESCENT else 0.05) * gap.initial, (
      f"{c.name}: loss {gap.initial:.3g} -> {gap.final:.3g}")
  assert gap.ratio <= gap_factor(name), f"{c.name}: {gap.ratio:.3g}× plain SGD's floor"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_DESCENT))
def test_error_feedback_gives_the_slow_ones_sgds_rate_below_lr_delta(name):
  """With error feedback at lr·L = 0.01 ≲ δ the slow ones come within SGD_RATE_GAP of plain
  SGD at that step size; at lr·L = 0.15 ≫ δ error feedback is no cure."""
  c = make(name)
  gap = convergence.quadratic_gap(c, **SGD_RATE)
  assert gap.ratio <= SGD_RATE_GAP, (
      f"{c.name}, {SGD_RATE}: {gap.ratio:.3g}× plain SGD's loss at that step size")
  fast = convergence.quadratic_gap(c, error_feedback=SGD_RATE["error_feedback"])
  assert fast.ratio > SGD_RATE_GAP, (
      f"{c.name}: error feedback at lr·L = 0.15 came within {fast.ratio:.3g}× of SGD; "
      "say so in docs/guide/guarantees.md")


GUARANTEES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "guarantees.md"


def _section(page, heading):
  text = page.split(f"\n{heading}\n", 1)[1]
  return text.split("\n#", 1)[0]


def _rows(section):
  """The cells of a markdown table's body rows, by the row's first cell without backquotes."""
  rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
          for line in section.splitlines() if line.startswith("| `")]
  return {cells[0].strip("`"): cells for cells in rows}


def test_the_guarantees_page_states_the_suites_factors():
  """docs/guide/guarantees.md lists every registered compressor with the factor the suite
  holds it to, and the slow ones' factor with error feedback, under the suite's conditions."""
  page = GUARANTEES.read_text()
  table = _rows(_section(page, "## Convergence at the defaults"))
  assert sorted(table) == NAMES
  for name, cells in table.items():
    assert cells[1] == f"{gap_factor(name):g}×", (name, cells)
    assert cells[-1].endswith(f"test_the_defaults_converge_on_a_noisy_strongly_convex_problem"
                              f"[{name}]`"), (name, cells)
  section = _section(page, "### Reaching SGD's rate")
  header = next(line for line in section.splitlines() if line.startswith("| compressor"))
  assert (f"lr·L = {SGD_RATE['lr']:g}" in header and f"{SGD_RATE['steps']} steps" in header
          and f"error_feedback={SGD_RATE['error_feedback']}" in header), header
  slow = _rows(section)
  assert sorted(slow) == sorted(SLOW_DESCENT)
  for name, cells in slow.items():
    assert f"{SGD_RATE_GAP:g}×" in cells, (name, cells)
    assert cells[-1].endswith(f"test_error_feedback_gives_the_slow_ones_sgds_rate_below_lr_delta"
                              f"[{name}]`"), (name, cells)
