"""Bad input fails with a ValueError naming the argument, the value and what is valid.

An option of the wrong type (a string or a bool where a number belongs, a float where an
integer does, anything but True/False where a bool does) raises a TypeError that is also a
ValueError; batches are checked when the step is traced.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt


@pytest.mark.parametrize("kwargs, match", [
    ({"k": 0}, r"`k` must be a positive integer, got 0"),
    ({"k": -3}, r"`k` must be a positive integer, got -3"),
    ({"ratio": 0.0}, r"`ratio` must be a fraction in \(0, 1\], got 0.0"),
    ({"ratio": 1.5}, r"`ratio` must be a fraction in \(0, 1\], got 1.5"),
    ({}, r"give exactly one of `ratio` and `k`"),
    ({"ratio": 0.1, "k": 3}, r"give exactly one of `ratio` and `k`"),
])
def test_top_k_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    commopt.top_k(**kwargs)


def test_top_k_k_larger_than_leaf():
  tx = commopt.compressed_mean(commopt.top_k(k=100), min_size=0)
  with pytest.raises(ValueError, match=r"`k` must be at most the leaf size, got k=100 "
                                       r".* \(size 50\)"):
    tx.update({"w": jnp.ones(50)}, tx.init({"w": jnp.ones(50)}))


@pytest.mark.parametrize("rank", [0, -1, 1.5])
def test_power_sgd_rank(rank):
  with pytest.raises(ValueError, match=rf"`rank` must be a positive integer, got {rank}"):
    commopt.power_sgd(rank=rank)


def test_power_sgd_view():
  with pytest.raises(ValueError, match="`view` must be 'last', 'first' or a callable"):
    commopt.power_sgd(view="middle")


def test_cast_dtype():
  with pytest.raises(ValueError, match=r"`dtype` must be one of .*got 'int8'"):
    commopt.cast("int8")


def test_integer_leaves_rejected():
  tx = commopt.compressed_mean(commopt.scaled_sign())
  with pytest.raises(ValueError, match=r"leaf \['step'\] has dtype int32.*floating-point"):
    tx.init({"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)})
  state = tx.init({"w": jnp.ones(4)})
  with pytest.raises(ValueError, match=r"leaf \['w'\] has dtype int32"):
    tx.update({"w": jnp.ones(4, jnp.int32)}, state)


def test_state_mismatch():
  tx = commopt.compressed_mean(commopt.scaled_sign(), min_size=0)
  state = tx.init({"w": jnp.ones((8, 8))})
  with pytest.raises(ValueError, match=r"state does not match `updates`.*shape \(8, 8\).*\(4, 4\)"):
    tx.update({"w": jnp.ones((4, 4))}, state)
  with pytest.raises(ValueError, match=r"state does not match `updates`"):
    tx.update({"w": jnp.ones((8, 8)), "extra": jnp.ones(3)}, state)


def test_none_leaves_pass_through():
  tx = commopt.compressed_mean(commopt.top_k(0.5), min_size=0)
  params = {"w": jnp.ones(8), "frozen": None}
  out, _ = tx.update({"w": jnp.arange(8.0), "frozen": None}, tx.init(params))
  assert out["frozen"] is None
  assert int(jnp.count_nonzero(out["w"])) == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "ring"}, r"`strategy` must be one of .*got 'ring'"),
    ({"min_size": -1}, r"`min_size` must be an integer >= 0, got -1"),
    ({"residual_dtype": jnp.int32}, r"`residual_dtype` must be a floating-point dtype"),
])
def test_compressed_mean_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    commopt.compressed_mean(commopt.scaled_sign(), **kwargs)


def test_psum_needs_linear_compressor():
  with pytest.raises(ValueError, match="strategy='psum' needs a linear compressor"):
    commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="psum")


def test_not_a_compressor():
  with pytest.raises(ValueError, match="`compressor` must be a commopt Compressor"):
    commopt.compressed_mean("sign")


def test_unknown_registry_name():
  with pytest.raises(ValueError, match=r"unknown compressor 'sgn'; valid names are"):
    commopt.compressors.make("sgn")


def test_make_refuses_an_option_the_compressor_does_not_take():
  # A misspelt option used to fall back silently to the default ratio.
  with pytest.raises(ValueError, match=r"'top_k' takes no option 'rato'; its options are "
                                       r"\['ratio'"):
    commopt.compressors.make("top_k", rato=0.5)
  with pytest.raises(ValueError, match="takes no option 'rank'"):
    commopt.compressors.make("scaled_sign", rank=None)
  assert commopt.compressors.make("top_k", ratio=None).name == "top_k(ratio=0.01)"
  assert "rank" in commopt.compressors.options("power_sgd")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_residual_dtype_for_16_bit_leaves(dtype):
  # float32 by default; the user may still ask for the leaf's own dtype.
  for asked, kept in ((None, jnp.float32), (dtype, dtype)):
    tx = commopt.compressed_mean(commopt.scaled_sign(), residual_dtype=asked, min_size=0)
    state = tx.init({"w": jnp.ones(64, dtype)})
    assert state.residual["w"].dtype == kept
    out, state = tx.update({"w": jnp.linspace(-1, 1, 64).astype(dtype)}, state)
    assert out["w"].dtype == dtype and state.residual["w"].dtype == kept
  state = commopt.compressed_mean(commopt.scaled_sign(), min_size=0).init({"w": jnp.ones(64)})
  assert state.residual["w"].dtype == jnp.float32


@pytest.mark.parametrize("name", ["scaled_sign", "top_k", "qsgd"])
def test_bf16_defaults_keep_a_small_gradient_beside_a_large_residual(name):
  """1e-3 added to a residual of 256: lost in bf16 (8 bits of mantissa), kept in float32."""

  def gradient_kept(**options):
    # What was sent plus what is kept, less the residual: the gradient, if nothing is lost.
    tx = commopt.compressed_mean(commopt.compressors.make(name), min_size=0,
                                 error_feedback=True, **options)
    state = tx.init({"w": jnp.ones(1024, jnp.bfloat16)})
    state = state._replace(residual={"w": jnp.full(1024, 256.0, state.residual["w"].dtype)})
    out, state = tx.update({"w": jnp.full(1024, 1e-3, jnp.bfloat16)}, state)
    return np.asarray(out["w"], np.float32) + np.asarray(state.residual["w"], np.float32) - 256

  np.testing.assert_allclose(gradient_kept(), 1e-3, rtol=2e-2)
  # With a bf16 residual, as one may still ask for, the gradient is lost.
  np.testing.assert_array_equal(gradient_kept(residual_dtype=jnp.bfloat16), 0.0)


def test_a_lossless_compressor_keeps_no_residual():
  """identity loses nothing: no error memory in the state, whatever error_feedback says."""
  import optax
  for ef in ("auto", True, False):
    tx = commopt.compressed_mean(commopt.compressors.identity(), min_size=0, error_feedback=ef)
    assert isinstance(tx.init({"w": jnp.ones(1024)}).residual["w"], optax.MaskedNode)


def test_a_bfloat16_cast_keeps_a_residual_only_when_asked():
  """cast("bfloat16") only rounds (at most 2^-8 of each value, float32's range): "auto"
  keeps no residual, as PyTorch's bf16 hook; True keeps one. float16 loses values below
  2^-24 whole, so "auto" keeps one for it."""
  import optax
  kept = lambda c, ef: not isinstance(
      commopt.compressed_mean(c, min_size=0, error_feedback=ef).init(
          {"w": jnp.ones(1024)}).residual["w"], optax.MaskedNode)
  bf16, f16 = commopt.cast("bfloat16"), commopt.cast("float16")
  assert bf16.error_kind == "rounding" and bf16.delta((1024,)) == 1 - 2.0 ** -16
  assert (kept(bf16, "auto"), kept(bf16, True), kept(bf16, False)) == (False, True, False)
  assert f16.error_kind == "biased" and f16.delta((1024,)) is None
  assert (kept(f16, "auto"), kept(f16, True)) == (True, True)
  # What a residual would keep for float16: a gradient under its smallest subnormal.
  tx = commopt.compressed_mean(f16, min_size=0)
  out, state = tx.update({"w": jnp.full(4, 1e-8)}, tx.init({"w": jnp.zeros(4)}))
  assert float(out["w"][0]) == 0.0 and float(state.residual["w"][0]) == pytest.approx(1e-8)


def test_two_phase_server_memory_is_float32_for_bf16():
  tx = commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", strategy="two_phase",
                               min_size=0)
  state = commopt.testing.vmap_workers(tx, 4, "data").init({"w": jnp.ones(64, jnp.bfloat16)})
  assert state.residual["w"].dtype == jnp.float32
  assert state.server_residual["w"].dtype == jnp.float32
  assert state.server_residual["w"].shape == (4, 16)


def test_inside_optax_masked():
  import optax
  tx = optax.masked(commopt.compressed_mean(commopt.scaled_sign(), min_size=0),
                    {"w": True, "step": False})
  params = {"w": jnp.ones((8, 8)), "step": jnp.zeros((), jnp.int32)}
  out, _ = tx.update({"w": jnp.ones((8, 8)), "step": jnp.zeros((), jnp.int32)}, tx.init(params))
  assert out["step"].dtype == jnp.int32


def test_state_mismatch_without_error_feedback():
  tx = commopt.compressed_mean(commopt.power_sgd(rank=1), error_feedback=False, min_size=0)
  state = tx.init({"w": jnp.ones((64, 32))})
  with pytest.raises(ValueError, match=r"state does not match `updates`.*compressor state"):
    tx.update({"w": jnp.ones((32, 64))}, state)


def test_make_with_k_and_zero_size_leaves():
  assert commopt.compressors.make("top_k", k=5).name == "top_k(k=5)"
  tx = commopt.compressed_mean(commopt.top_k(0.5), min_size=0)
  out, _ = tx.update({"e": jnp.zeros((0, 4))}, tx.init({"e": jnp.zeros((0, 4))}))
  assert out["e"].shape == (0, 4)
  assert commopt.top_k(0.07).payload_bits((100,), jnp.float32) == 7 * 64


# -- strict option types -------------------------------------------------------

@pytest.mark.parametrize("make, option, value", [
    (lambda v: commopt.top_k(ratio=v), "ratio", "0.1"),
    (lambda v: commopt.top_k(ratio=v), "ratio", True),
    (lambda v: commopt.top_k(k=v), "k", 5.0),
    (lambda v: commopt.int_quant(bits=v), "bits", 8.0),
    (lambda v: commopt.int_quant(bits=v), "bits", True),
    (lambda v: commopt.power_sgd(batched=v), "batched", 1),
    (lambda v: commopt.random_k(0.1, shared_seed=v), "shared_seed", "no"),
])
def test_the_reported_options_are_refused_when_built(make, option, value):
  with pytest.raises(TypeError, match=rf"`{option}` must be .*got {re.escape(repr(value))}"):
    make(value)


def test_an_option_of_the_wrong_type_is_also_a_value_error():
  # Code that catches the ValueError of every other bad argument still catches these.
  with pytest.raises(ValueError, match="`ratio`"):
    commopt.top_k(ratio="0.1")
  with pytest.raises(ValueError, match="`bits`"):
    commopt.int_quant(bits=8.0)


def test_a_wrong_type_message_says_what_to_pass():
  with pytest.raises(TypeError, match=r"got 8\.0 \(float\).*pass 8"):
    commopt.int_quant(bits=8.0)
  with pytest.raises(TypeError, match=r"got '0\.1' \(str\).*pass 0\.1"):
    commopt.top_k(ratio="0.1")
  with pytest.raises(TypeError, match=r"got 'no' \(str\).*pass True or False"):
    commopt.top_k(0.1, approx="no")


def _inner():
  return optax.sgd(0.1)


def _loss(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


FACTORY_OPTIONS = [
    # compressed_mean (its error_feedback takes more than a bool; see its docstring)
    (lambda **kw: commopt.compressed_mean(commopt.scaled_sign(), **kw),
     [("min_size", "8"), ("min_size", 8.0), ("min_size", True), ("seed", "0"), ("seed", 1.5),
      ("strategy", 1)]),
    (lambda **kw: commopt.transforms.dgc(**kw),
     [("nesterov", "no"), ("nesterov", 1), ("momentum", "0.9"), ("momentum", True),
      ("clip_norm", "1.0"), ("min_size", 8.0), ("seed", "0"), ("densities", "0.01"),
      ("method", 1)]),
    (lambda **kw: commopt.transforms.scheduled_top_k(**{"densities": 0.1, **kw}),
     [("densities", "0.1"), ("densities", True), ("method", True)]),
    (lambda **kw: commopt.diloco(_inner(), **{"axis_name": "data", "period": 4, **kw}),
     [("period", 4.0), ("period", True), ("error_feedback", "no"), ("error_feedback", None),
      ("warmup_steps", "1"), ("min_size", 1.5), ("seed", "0"), ("strategy", 1)]),
    (lambda **kw: commopt.local_sgd(_inner(), **{"axis_name": "data", "period": 4, **kw}),
     [("period", "4"), ("error_feedback", 0), ("warmup_steps", 1.0), ("seed", True)]),
    (lambda **kw: commopt.streaming_diloco(_inner(), **{"axis_name": "data", "period": 4, **kw}),
     [("fragments", 2.0), ("delay", True), ("mixing", "0.5"), ("error_feedback", "yes")]),
    (lambda **kw: commopt.transforms.easgd(_inner(), **{"axis_name": "data", "alpha": 0.5, **kw}),
     [("alpha", "0.5"), ("alpha", True), ("beta", "0.1"), ("period", 2.0),
      ("error_feedback", 1)]),
    (lambda **kw: commopt.transforms.stale(_inner(), **{"axis_name": "data", "max_staleness": 2,
                                                        **kw}),
     [("max_staleness", 2.0), ("distribution", 1), ("mean_staleness", "1"),
      ("byte_budget", 1e6), ("error_feedback", "no"), ("seed", 0.0)]),
    (lambda **kw: commopt.onebit_adam(**{"learning_rate": 1e-3, "freeze_step": 10,
                                         "axis_name": "data", **kw}),
     [("freeze_step", 10.0), ("learning_rate", "1e-3"), ("b1", "0.9"), ("eps", True),
      ("weight_decay", "0"), ("min_size", 1.5), ("seed", "0"), ("strategy", 2)]),
    (lambda **kw: commopt.transforms.onebit_lamb(**{"learning_rate": 1e-3, "freeze_step": 10,
                                         "axis_name": "data", **kw}),
     [("max_coeff", "10"), ("coeff_beta", True), ("factor_max", "4"), ("freeze_step", "10")]),
    (lambda **kw: commopt.transforms.zero_one_adam(**{"learning_rate": 1e-3, "axis_name": "data",
                                                      **kw}),
     [("var_freeze_step", 100.0), ("var_update_scaler", "16"), ("local_step_clipper", True),
      ("b2", "0.999")]),
    (lambda **kw: commopt.transforms.fetch_sgd(**{"learning_rate": 0.1, "k": 10, "rows": 3,
                                                  "cols": 64, "axis_name": "data", **kw}),
     [("k", 10.0), ("rows", "3"), ("cols", True), ("momentum", "0.9"), ("seed", True),
      ("zeroing", 1)]),
    (lambda **kw: commopt.transforms.sfb_mean(**{"axis_name": "data", "batch_rows": 8,
                                      "mask": {"w": True}, **kw}),
     [("batch_rows", 8.0), ("check_rows", "no")]),
    (lambda **kw: commopt.multi_steps(_inner(), **{"every_k_schedule": 2, **kw}),
     [("every_k_schedule", 2.0), ("every_k_schedule", True)]),
    (lambda **kw: commopt.apply_if_finite(_inner(), **kw),
     [("max_consecutive_errors", 2.0), ("max_consecutive_errors", "2")]),
    (lambda **kw: commopt.majority_vote(**kw), [("axis_name", 1)]),
    (lambda **kw: commopt.aggregators.krum(**{"axis_name": "data", "f": 1, **kw}),
     [("f", 1.0), ("f", True), ("error_feedback", "no"), ("min_size", "0"), ("seed", 0.5)]),
    (lambda **kw: commopt.aggregators.multi_krum(**{"axis_name": "data", "f": 1, **kw}),
     [("m", 2.0)]),
    (lambda **kw: commopt.aggregators.trimmed_mean(**{"axis_name": "data", "beta": 0.1, **kw}),
     [("beta", "0.1"), ("f", "1")]),
    (lambda **kw: commopt.aggregators.coordinate_median(**{"axis_name": "data", **kw}),
     [("f", "1"), ("error_feedback", 0)]),
    (lambda **kw: commopt.aggregators.geometric_median(**{"axis_name": "data", **kw}),
     [("iters", 8.0), ("nu", "1e-6")]),
    (lambda **kw: commopt.aggregators.centered_clip(**{"axis_name": "data", "tau": 1.0, **kw}),
     [("tau", True), ("iters", 1.5)]),
    (lambda **kw: commopt.aggregators.robust_aggregate(
        **{"rule": lambda x: x[0], "axis_name": "data", **kw}),
     [("coordinatewise", "no"), ("with_previous", 1), ("seed", "0")]),
    (lambda **kw: commopt.aggregators.attacks.attack(
        **{"kind": "gaussian", "axis_name": "data", "byzantine": (0,), **kw}),
     [("kind", 1), ("seed", "0"), ("sigma", "1.0"), ("sigma", True)]),
    (lambda **kw: commopt.aggregators.attacks.bit_flip((0,), **kw),
     [("rate", "0.1"), ("rate", True), ("floats", "no")]),
    (lambda **kw: commopt.data_parallel(_loss, _inner(), jax.make_mesh((1,), ("data",)), **kw),
     [("skip_nonfinite", "no"), ("donate", 1), ("has_aux", None), ("has_state", 0),
      ("local_params", "False"), ("model_state_sync", 1)]),
]
FACTORY_CASES = [(make, option, value) for make, cases in FACTORY_OPTIONS
                 for option, value in cases]


@pytest.mark.parametrize("make, option, value", FACTORY_CASES,
                         ids=[f"{i}-{o}={v!r}" for i, (_, o, v) in enumerate(FACTORY_CASES)])
def test_factories_refuse_options_of_the_wrong_type(make, option, value):
  with pytest.raises(TypeError) as info:
    make(**{option: value})
  assert f"`{option}`" in str(info.value) and repr(value) in str(info.value), str(info.value)


@pytest.mark.parametrize("make, option", [
    (lambda: commopt.compressed_mean("sign"), "compressor"),
    (lambda: commopt.aggregators.krum(1, axis_name="data", compressor="int_quant"), "compressor"),
    (lambda: commopt.aggregators.coordinate_median(axis_name="data", payload_attack="bit_flip"),
     "payload_attack"),
    (lambda: commopt.diloco("sgd", axis_name="data", period=4), "inner"),
    (lambda: commopt.apply_if_finite(None), "inner"),
    (lambda: commopt.data_parallel(1, _inner(), jax.make_mesh((1,), ("data",))), "loss_fn"),
    (lambda: commopt.data_parallel(_loss, "sgd", jax.make_mesh((1,), ("data",))), "tx"),
    (lambda: commopt.data_parallel(_loss, _inner(), ("data",)), "mesh"),
])
def test_an_argument_of_the_wrong_kind_of_object_is_a_type_error(make, option):
  with pytest.raises(TypeError, match=rf"`{option}` must be"):
    make()


def test_nnx_data_parallel_refuses_a_non_bool_has_aux():
  from flax import nnx
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=r"`has_aux` must be .*got 'no'"):
    commopt.nnx_data_parallel(model, lambda m, b: jnp.mean(m(b["x"])), _inner(),
                              jax.make_mesh((1,), ("data",)), has_aux="no")


# -- batches -------------------------------------------------------------------

def _dp(mesh, **kw):
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0),
                   optax.sgd(0.1))
  return commopt.data_parallel(_loss, tx, mesh, **kw)


def _params():
  return {"w": jnp.zeros((4, 1))}


def test_batch_leaves_must_share_their_leading_size(mesh):
  dp = _dp(mesh)
  params = _params()
  # 4 rows of x and 1 row of y per worker would broadcast: rows silently mispaired.
  batch = {"x": jnp.ones((32, 4)), "y": jnp.ones((8, 1))}
  match = r"share .*leading.*\['x'\]: \(32, 4\).*\['y'\]: \(8, 1\)"
  with pytest.raises(ValueError, match=match):
    dp.step(params, dp.init(params), batch)
  with pytest.raises(ValueError, match=match):
    dp.place_batch(batch)
  with pytest.raises(ValueError, match=match):
    dp.local_batch(batch)
  # Inside the user's jit and scan, where the shapes are static too.
  with pytest.raises(ValueError, match=match):
    jax.jit(dp.step)(params, dp.init(params), batch)
  with pytest.raises(ValueError, match=r"\['x'\]: \(32, 4\).*\['y'\]: \(8, 1\)"):
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), batch)
    jax.lax.scan(lambda c, b: (dp.step(*c, b)[:2], None), (params, dp.init(params)), stacked)


def test_an_empty_batch_is_refused(mesh):
  dp = _dp(mesh)
  params = _params()
  batch = {"x": jnp.ones((0, 4)), "y": jnp.ones((0, 1))}
  match = r"empty.*\['x'\]: \(0, 4\).*\['y'\]: \(0, 1\)"
  with pytest.raises(ValueError, match=match):
    dp.step(params, dp.init(params), batch)
  with pytest.raises(ValueError, match=match):
    jax.jit(dp.step_fn)(params, dp.init(params), batch)
  with pytest.raises(ValueError, match=r"empty"):
    dp.step(params, dp.init(params), {"x": jnp.ones((0, 4)), "y": jnp.ones((0, 1)),
                                      "w": jnp.ones(0)})


def test_batch_leaves_need_a_leading_axis_divisible_by_the_workers(mesh):
  dp = _dp(mesh)
  params = _params()
  with pytest.raises(ValueError, match=r"batch leaf \['t'\] has shape \(\), with no leading axis"):
    dp.step(params, dp.init(params), {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 1)),
                                      "t": jnp.ones(())})
  with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(12, 4\); its leading "
                                       r"axis must be divisible by the 8 workers on axis 'data'"):
    dp.step(params, dp.init(params), {"x": jnp.ones((12, 4)), "y": jnp.ones((12, 1))})


def test_batch_shapes_are_checked_once_per_trace(mesh, monkeypatch):
  dp = _dp(mesh)
  calls = []
  check = commopt.DataParallel._check_batch
  monkeypatch.setattr(commopt.DataParallel, "_check_batch",
                      lambda self, *a, **kw: (calls.append(1), check(self, *a, **kw))[1])
  params = _params()
  state = dp.init(params)
  batch = {"x": jnp.ones((16, 4)), "y": jnp.ones((16, 1))}
  for _ in range(3):
    params, state, losses = dp.step(params, state, batch)
  assert len(calls) == 1
  assert bool(jnp.all(jnp.isfinite(losses)))


def test_nnx_step_checks_the_batch(mesh):
  from flax import nnx
  model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
  tx = optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                   optax.sgd(0.1))
  trainer = commopt.nnx_data_parallel(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                      tx, mesh)
  state = trainer.init(model)
  with pytest.raises(ValueError, match=r"\['x'\]: \(32, 4\).*\['y'\]: \(8, 1\)"):
    trainer.step(state, {"x": jnp.ones((32, 4)), "y": jnp.ones((8, 1))})
  with pytest.raises(ValueError, match=r"empty"):
    trainer.step_fn(state, {"x": jnp.ones((0, 4)), "y": jnp.ones((0, 1))})
