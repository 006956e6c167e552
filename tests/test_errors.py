"""Bad input fails with a ValueError naming the argument, the value and what is valid."""

import jax.numpy as jnp
import numpy as np
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
  with pytest.raises(ValueError, match=r"`k` must be at most the leaf size, got k=100 .* \(size 50\)"):
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
    commopt.compressed_mean(commopt.scaled_sign(), "data", strategy="psum")


def test_not_a_compressor():
  with pytest.raises(ValueError, match="`compressor` must be a commopt Compressor"):
    commopt.compressed_mean("sign")


def test_unknown_registry_name():
  with pytest.raises(ValueError, match=r"unknown compressor 'sgn'; valid names are"):
    commopt.compressors.make("sgn")


def test_make_refuses_an_option_the_compressor_does_not_take():
  # A misspelt option used to fall back silently to the default ratio.
  with pytest.raises(ValueError, match=r"'top_k' takes no option 'rato'; its options are \['ratio'"):
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


@pytest.mark.parametrize("name", ["identity", "scaled_sign", "top_k"])
def test_bf16_defaults_keep_a_small_gradient_beside_a_large_residual(name):
  """1e-3 added to a residual of 256: lost in bf16 (8 bits of mantissa), kept in float32."""

  def gradient_kept(**options):
    # What was sent plus what is kept, less the residual: the gradient, if nothing is lost.
    tx = commopt.compressed_mean(commopt.compressors.make(name), min_size=0, **options)
    state = tx.init({"w": jnp.ones(1024, jnp.bfloat16)})
    state = state._replace(residual={"w": jnp.full(1024, 256.0, state.residual["w"].dtype)})
    out, state = tx.update({"w": jnp.full(1024, 1e-3, jnp.bfloat16)}, state)
    return np.asarray(out["w"], np.float32) + np.asarray(state.residual["w"], np.float32) - 256

  np.testing.assert_allclose(gradient_kept(), 1e-3, rtol=2e-2)
  # With a bf16 residual, as one may still ask for, the gradient is lost.
  np.testing.assert_array_equal(gradient_kept(residual_dtype=jnp.bfloat16), 0.0)


def test_two_phase_server_memory_is_float32_for_bf16():
  tx = commopt.compressed_mean(commopt.scaled_sign(), "data", strategy="two_phase", min_size=0)
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
