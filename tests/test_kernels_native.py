"""Every Pallas kernel compiled for the GPU (not interpreted) against its jnp reference.

Skipped without a GPU. Random inputs at ragged sizes (not multiples of any block or
word), every bit width, ties, ±0, ±inf, NaN and bfloat16, with the kernels' default
block sizes as well as small ones. Payloads must be bit-identical to the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import commopt
import commopt.testing
from commopt import kernels
from commopt._src import bits as bitops

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="native Pallas kernels need a GPU backend")

NATIVE = {"implementation": "pallas", "interpret": False}
XLA = {"implementation": "xla"}
SIZES = [1, 31, 1000, 65_537, 1_000_003]


mixed = commopt.testing.checks.hard_floats


def same(a, b):
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [None, 64])
def test_pack_and_unpack(bits, n, block):
  codes = jnp.asarray(np.random.default_rng(n * bits).integers(0, 2**bits, n), jnp.int32)
  kw = {} if block is None else {"block": block}
  words = jax.jit(lambda c: kernels.pack_bits(c, bits, **kw, **NATIVE))(codes)
  same(words, bitops.pack(codes, bits))
  same(jax.jit(lambda w: kernels.unpack_bits(w, bits, n, **kw, **NATIVE))(words), codes)


def test_pack_booleans_and_uint8():
  mask = jnp.asarray(np.random.default_rng(0).random(70_001) < 0.5)
  same(kernels.pack_bits(mask, 1, **NATIVE), bitops.pack(mask, 1))
  codes = jnp.arange(70_001, dtype=jnp.uint8) % 16
  same(kernels.pack_bits(codes, 4, **NATIVE), bitops.pack(codes, 4))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", [None, 7, 256, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sign_pack(n, block_size, dtype):
  x = mixed(n, n, specials=False, dtype=dtype) * 10
  want = jax.jit(lambda v: kernels.sign_pack(v, block_size, **XLA))(x)
  got = jax.jit(lambda v: kernels.sign_pack(v, block_size, **NATIVE))(x)
  same(got[1], want[1])
  same(got[0], want[0])


def test_sign_pack_specials():
  """-0.0 and NaN send +; an inf makes its block's scale inf, a NaN makes it NaN."""
  x = mixed(100_003, 3)
  for block_size in (None, 32, 1000):
    want = kernels.sign_pack(x, block_size, **XLA)
    got = kernels.sign_pack(x, block_size, **NATIVE)
    same(got[1], want[1])
    same(got[0], want[0])
  same(kernels.sign_bits(x.astype(jnp.bfloat16), **NATIVE), bitops.pack(x.astype(jnp.bfloat16) < 0, 1))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", [None, 7, 32, 256, 4096])
@pytest.mark.parametrize("block", [None, 1024])
def test_sign_feedback(n, block_size, block):
  """Error feedback fused with the sign encoding (one pass where each scale block fits a
  program, two otherwise) against the reference, partial last blocks included."""
  u, e = mixed(n, n, specials=False) * 10, mixed(n, n + 1, specials=False)
  kw = {} if block is None else {"block": block}
  want = jax.jit(lambda u, e: kernels.sign_feedback(u, e, block_size, **kw, **XLA))(u, e)
  got = jax.jit(lambda u, e: kernels.sign_feedback(u, e, block_size, **kw, **NATIVE))(u, e)
  for a, b in zip(got, want):
    same(a, b)


def _scales(x, block_size, norm):
  n = x.size
  size = n if block_size is None else min(block_size, n)
  blocks = jnp.pad(x, (0, -(-n // size) * size - n)).reshape(-1, size)
  s = jnp.linalg.norm(blocks, axis=1) if norm else jnp.max(jnp.abs(blocks), axis=1)
  return s.at[0].set(0.0) if s.size > 1 else s


@pytest.mark.parametrize("levels", [1, 7, 127])   # 2, 4 and 8 bits per code
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", [None, 128, 4097])
def test_quantize_pack_qsgd(levels, n, block_size):
  x = mixed(n, levels + n, specials=False)
  r = jax.random.bits(jax.random.key(n), (n,), jnp.uint32)
  s = _scales(x, block_size, norm=True)
  f = lambda **o: jax.jit(lambda v: kernels.quantize_pack(v, r, levels, s, block_size=block_size, **o))(x)
  same(f(**NATIVE), f(**XLA))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_size", [None, 64])
def test_quantize_pack_terngrad_with_nan(n, block_size):
  x = mixed(n, n, specials=False).at[n // 2].set(jnp.nan)
  r = jax.random.bits(jax.random.key(n + 1), (n,), jnp.uint32)
  s = _scales(x, block_size, norm=False)
  kw = {"block_size": block_size, "style": "terngrad"}
  same(kernels.quantize_pack(x, r, 1, s, **kw, **NATIVE), kernels.quantize_pack(x, r, 1, s, **kw, **XLA))


brute_top_k = commopt.testing.checks.top_k_indices


@pytest.mark.parametrize("n, k", [(1, 1), (1000, 1), (1000, 999), (65_537, 655),
                                  (1_000_003, 10_000), (4_000_037, 40_000)])
def test_select_top_k(n, k):
  x = mixed(n, n + k)
  values, indices = jax.jit(lambda v: kernels.select_top_k(v, k, **NATIVE))(x)
  want_values, want_indices = jax.jit(lambda v: kernels.select_top_k(v, k, **XLA))(x)
  same(indices, want_indices)
  same(indices, brute_top_k(x, k))
  same(values, want_values)


@given(seed=st.integers(0, 2**31), k=st.sampled_from([1, 50, 3000]),
       radix_bits=st.sampled_from([3, 4, 8]))
@settings(max_examples=12, deadline=None)
def test_select_top_k_property(seed, k, radix_bits):
  x = mixed(30_011, seed)
  _, indices = kernels.select_top_k(x, k, radix_bits=radix_bits, **NATIVE)
  same(indices, brute_top_k(x, k))


@pytest.mark.parametrize("n", SIZES + [4_000_037])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_first_true(n, density):
  from commopt._src import base
  mask = jnp.asarray(np.random.default_rng(n).random(n) < density)
  for capacity in (1, max(1, n // 100), n, n + 5):
    got = jax.jit(lambda m: kernels.first_true(m, capacity, **NATIVE))(mask)
    same(got, base.first_true(mask, capacity))


def test_select_top_k_sampled_on_large_leaves():
  """The sampled two-pass select (its bound held) against the reference at 16M elements."""
  from commopt.kernels.select import pallas as select_pallas
  x = jax.random.normal(jax.random.key(0), (16 * 2**20 + 3,))
  for k in (1, 16_000, 170_000):
    assert bool(select_pallas.sampled_bound(x, k, 1024)[3])
    got = jax.jit(lambda v: kernels.select_top_k(v, k, **NATIVE))(x)
    want = jax.jit(lambda v: kernels.select_top_k(v, k, **XLA))(x)
    same(got[1], want[1])
    same(got[0], want[0])


def test_select_top_k_ties_and_bf16():
  same(kernels.select_top_k(-jnp.ones(50_000), 777, **NATIVE)[1], np.arange(777))
  xb = mixed(70_001, 2, dtype=jnp.bfloat16)
  values, indices = kernels.select_top_k(xb, 900, **NATIVE)
  same(indices, brute_top_k(xb.astype(jnp.float32), 900))
  assert values.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["sign", "scaled_sign", "onebit", "terngrad", "qsgd", "top_k",
                                  "gradient_dropping", "adacomp", "threshold",
                                  "int_quant", "natural", "atomo", "variance_balanced"])
def test_compressor_payloads_are_the_same_with_either_implementation(name):
  """``auto`` (the kernels on a GPU) and ``xla`` encode the same payload bit for bit."""
  c = commopt.compressors.make(name)
  x = mixed(300_007, 1, specials=False)
  key = jax.random.key(0)
  state = c.init(x)
  with kernels.implementation("xla"):
    want = jax.jit(lambda v, s: c.encode(v, s, key))(x, state)[0]
  with kernels.implementation("pallas", interpret=False):
    got = jax.jit(lambda v, s: c.encode(v, s, key))(x, state)[0]
  jax.tree.map(same, got, want)


@pytest.mark.parametrize("name", ["scaled_sign", "qsgd", "top_k", "natural", "terngrad"])
def test_kernels_inside_data_parallel_match_the_reference(name):
  """The kernels run inside the step's shard_map (typed outputs) and give the XLA path's step.

  Bit for bit, except qsgd: its decode ends in an inexact product, which the
  compiler may contract with a neighbouring add on one side of the kernel
  boundary and not the other (1 ulp).
  """
  import optax
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  params = {"w": jnp.ones((256, 512)) * 0.01}
  batch = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(8 * mesh.size, 256)), jnp.float32)}

  def loss(p, b):
    return jnp.mean((b["x"] @ p["w"]) ** 2)

  def step(implementation):
    tx = optax.chain(commopt.compressed_mean(commopt.compressors.make(name), axis_name="data"),
                     optax.sgd(0.1))
    dp = commopt.data_parallel(loss, tx, mesh, donate=False)
    p, s = params, dp.init(params)
    with kernels.implementation(implementation):
      for _ in range(3):
        p, s, _ = dp.step(p, s, batch)
    return p

  got, want = step("pallas")["w"], step("xla")["w"]
  if name == "qsgd":
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
  else:
    same(got, want)
