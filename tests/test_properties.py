"""Property tests: bit packing, top-k, and error-feedback conservation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import commopt
from commopt._src import bits


def test_sign_bits_layout():
  # Code i sits at bit i % 32 of word i // 32.
  codes = np.zeros(40, np.uint32)
  codes[[0, 5, 33]] = 1
  words = np.asarray(bits.pack(jnp.asarray(codes), 1))
  assert words.tolist() == [1 | (1 << 5), 1 << 1]


@given(shape=st.sampled_from([(7,), (40, 3), (5, 6, 7)]), k=st.integers(1, 7), seed=st.integers(0, 2**31))
@pytest.mark.slow
def test_top_k_exact_count_selection_and_contraction(shape, k, seed):
  x = jnp.asarray(np.random.default_rng(seed).permutation(np.prod(shape)) + 1.0, jnp.float32)
  x = (x * jnp.where(jnp.arange(x.size) % 2 == 0, 1.0, -1.0)).reshape(shape)
  c = commopt.top_k(k=k)
  payload, _ = c.encode(x, c.init(x), None)
  y = c.decode(payload, None, x)
  assert int(jnp.count_nonzero(y)) == k
  _, expected = jax.lax.top_k(jnp.abs(x.reshape(-1)), k)
  assert set(np.asarray(payload["indices"]).tolist()) == set(np.asarray(expected).tolist())
  d = x.size
  assert float(jnp.sum((x - y) ** 2)) <= (1 - k / d) * float(jnp.sum(x**2)) + 1e-3


@pytest.mark.slow
@given(seed=st.integers(0, 2**31), ratio=st.floats(0.001, 1.0))
def test_top_k_ratio_contraction(seed, ratio):
  x = jnp.asarray(np.random.default_rng(seed).normal(size=(33, 17)), jnp.float32)
  c = commopt.top_k(ratio)
  payload, _ = c.encode(x, c.init(x), None)
  k = payload["values"].size
  assert k == max(1, int(np.ceil(ratio * x.size)))
  y = c.decode(payload, None, x)
  assert float(jnp.sum((x - y) ** 2)) <= (1 - k / x.size) * float(jnp.sum(x**2)) * (1 + 1e-5)


@given(name=st.sampled_from(["scaled_sign", "top_k", "power_sgd"]), seed=st.integers(0, 2**31),
       steps=st.integers(1, 8))
@pytest.mark.slow
def test_error_feedback_conservation_local(name, seed, steps):
  """One worker: the outputs plus the final residual equal the inputs."""
  tx = commopt.compressed_mean(commopt.compressors.make(name), min_size=0)
  rng = np.random.default_rng(seed)
  params = {"w": jnp.zeros((24, 20))}
  state = tx.init(params)
  update = jax.jit(tx.update)
  total_in = total_out = np.zeros((24, 20))
  for _ in range(steps):
    u = {"w": jnp.asarray(rng.normal(size=(24, 20)), jnp.float32)}
    out, state = update(u, state)
    total_in = total_in + np.asarray(u["w"])
    total_out = total_out + np.asarray(out["w"])
  np.testing.assert_allclose(total_out + np.asarray(state.residual["w"]), total_in, atol=1e-4)


def test_error_feedback_off_keeps_no_residual():
  tx = commopt.compressed_mean(commopt.scaled_sign(), error_feedback=False, min_size=0)
  state = tx.init({"w": jnp.zeros(64)})
  assert not jax.tree.leaves(state.residual)


def test_scaled_sign_payload_is_packed():
  c = commopt.scaled_sign()
  x = jnp.asarray(np.random.default_rng(0).normal(size=1000), jnp.float32)
  payload, _ = c.encode(x, c.init(x), None)
  assert payload["signs"].dtype == jnp.uint32 and payload["signs"].shape == (32,)
  y = c.decode(payload, None, x)
  np.testing.assert_allclose(np.abs(y), float(jnp.mean(jnp.abs(x))), rtol=1e-6)
  np.testing.assert_array_equal(np.sign(y), np.where(np.asarray(x) < 0, -1.0, 1.0))


def test_compressed_mean_after_optimizer_compresses_updates():
  """EF-SGD: compress the step (learning rate inside) after the optimizer."""
  import optax
  tx = optax.chain(optax.sgd(0.5), commopt.compressed_mean(commopt.scaled_sign(), min_size=0))
  params = {"w": jnp.array([1.0, -2.0, 3.0, -4.0])}
  state = tx.init(params)
  for _ in range(200):
    grads = {"w": params["w"]}  # gradient of ||w||^2 / 2
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert float(jnp.max(jnp.abs(params["w"]))) < 0.05
