"""Pallas kernels in interpret mode against their pure-jnp references (exact)."""

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
from commopt._src import rng

PALLAS = {"implementation": "pallas", "interpret": True}
OFF_GPU = pytest.mark.skipif(jax.default_backend() == "gpu",
                             reason="checks what happens without a GPU "
                                    "(tests/test_kernels_native.py runs on one)")


mixed = commopt.testing.checks.hard_floats


# --- dispatch ---------------------------------------------------------------------


@OFF_GPU
def test_auto_is_the_reference_on_cpu():
  assert jax.default_backend() == "cpu"
  assert not kernels._dispatch.use_pallas("auto", False, "f")
  assert kernels._dispatch.use_pallas("auto", True, "f")
  assert not kernels._dispatch.use_pallas("auto", True, "f", "no")


@pytest.mark.parametrize("call, match", [
    (lambda: kernels.pack_bits(jnp.ones(4, jnp.int32), 2, implementation="gpu"),
     r"`implementation` must be one of \('auto', 'xla', 'pallas'\), got 'gpu'"),
    (lambda: kernels.pack_bits(jnp.ones(4, jnp.int32), 2, implementation="pallas"),
     r"needs a GPU backend, got 'cpu'; pass interpret=True"),
    (lambda: kernels.pack_bits(jnp.ones(4, jnp.int32), 3, **PALLAS),
     r"packs only \(1, 2, 4, 8\) bits per code, got bits=3"),
    (lambda: kernels.pack_bits(jnp.ones(4), 2), r"`codes` must be an integer or boolean"),
    (lambda: kernels.pack_bits(jnp.ones(4, jnp.int32), 2, block=48),
     r"`block` must be a power of two >= 32, got 48"),
    (lambda: kernels.unpack_bits(jnp.ones(1, jnp.uint32), 2, 17),
     r"`size` must be an integer in \[0, 16\]"),
    (lambda: kernels.sign_pack(jnp.ones(4), block_size=0),
     r"`block_size` must be None or a positive"),
    (lambda: kernels.sign_pack(jnp.ones(4, jnp.int32)), r"`x` must be a floating-point array"),
    (lambda: kernels.select_top_k(jnp.ones(4), 5),
     r"`k` must be an integer in \[1, 4\] \(x.size\), got 5"),
    (lambda: kernels.select_top_k(jnp.ones(4), 0), r"got 0"),
    (lambda: kernels.select_top_k(jnp.ones(4), 1, radix_bits=9), r"`radix_bits` must be"),
    (lambda: kernels.select_top_k(jnp.ones(4), 1, interpret=1),
     r"`interpret` must be True or False"),
    (lambda: kernels.quantize_pack(jnp.ones(4), jnp.ones(4, jnp.uint32), 2, jnp.ones(1),
                                   style="terngrad"),
     r"`levels` must be 1 for style='terngrad', got 2"),
    (lambda: kernels.quantize_pack(jnp.ones(4), jnp.ones(3, jnp.uint32), 1, jnp.ones(1)),
     r"`random_bits` must be uint32 with 4 elements"),
    (lambda: kernels.quantize_pack(jnp.ones(4), jnp.ones(4, jnp.uint32), 1, jnp.ones(1),
                                   block_size=2), r"`scales` must have 2 entries"),
    (lambda: kernels.quantize_pack(jnp.ones(4), jnp.ones(4, jnp.uint32), 1, jnp.ones(1),
                                   style="nf4"), r"`style` must be one of \('qsgd', 'terngrad'\)"),
])
def test_errors_name_the_argument_and_the_valid_values(call, match):
  if "needs a GPU" in match and jax.default_backend() == "gpu":
    pytest.skip("a GPU backend runs the kernel")
  with pytest.raises(ValueError, match=match):
    call()


def test_auto_falls_back_to_the_reference_for_widths_pallas_does_not_pack():
  codes = jnp.arange(20, dtype=jnp.int32) % 8
  got = kernels.pack_bits(codes, 3, interpret=True)
  np.testing.assert_array_equal(got, bitops.pack(codes, 3))


# --- packing ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [33, 257])
def test_pack_and_unpack_bits_match_the_reference(bits, n):
  """Sizes below, at and above the 64-code block, and not multiples of it or of a word."""
  codes = jnp.asarray(np.random.default_rng(n + bits).integers(0, 2**bits, n), jnp.int32)
  want = bitops.pack(codes, bits)
  got = kernels.pack_bits(codes, bits, block=64, **PALLAS)
  assert got.dtype == jnp.uint32 and got.shape == want.shape
  np.testing.assert_array_equal(got, want)
  back = kernels.unpack_bits(got, bits, n, block=64, **PALLAS)
  np.testing.assert_array_equal(back, bitops.unpack(want, n, bits))
  np.testing.assert_array_equal(back, codes)


def test_pack_bits_takes_booleans_and_small_dtypes():
  mask = jnp.asarray(np.random.default_rng(0).random(70) < 0.5)
  np.testing.assert_array_equal(kernels.pack_bits(mask, 1, block=32, **PALLAS),
                                bitops.pack(mask, 1))
  codes = jnp.arange(70, dtype=jnp.uint8) % 16
  np.testing.assert_array_equal(kernels.pack_bits(codes, 4, block=32, **PALLAS),
                                bitops.pack(codes, 4))


@given(data=st.data(), bits=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=8)
def test_pack_bits_round_trip_property(data, bits):
  n = 45
  codes = jnp.asarray(data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=n, max_size=n)),
                      jnp.int32)
  words = kernels.pack_bits(codes, bits, block=32, **PALLAS)
  np.testing.assert_array_equal(words, bitops.pack(codes, bits))
  np.testing.assert_array_equal(kernels.unpack_bits(words, bits, n, block=32, **PALLAS), codes)


# --- sign + scale + pack ----------------------------------------------------------


@pytest.mark.parametrize("n, block_size", [(1, None), (100, None), (257, None), (257, 48),
                                           (257, 7), (200, 64), (100, 1000)])
def test_sign_pack_matches_the_reference(n, block_size):
  x = mixed(n, n, specials=False)
  want_scales, want_words = kernels.sign_pack(x, block_size, implementation="xla")
  scales, words = kernels.sign_pack(x, block_size, block=64, **PALLAS)
  np.testing.assert_array_equal(words, want_words)
  np.testing.assert_allclose(scales, want_scales, rtol=2e-6)
  assert scales.shape == want_scales.shape == (-(-n // (block_size or n))
                                               if block_size and block_size < n else 1,)


def test_sign_pack_specials_and_bf16():
  """-0.0 and NaN are sent as +; an inf makes its block's scale inf, a NaN makes it NaN."""
  x = mixed(100, 3)
  _, words = kernels.sign_pack(x, 32, block=32, **PALLAS)
  np.testing.assert_array_equal(words, bitops.pack(x < 0, 1))
  scales, _ = kernels.sign_pack(x, 32, block=32, **PALLAS)
  np.testing.assert_allclose(scales, kernels.sign_pack(x, 32, implementation="xla")[0], rtol=2e-6)
  xb = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(kernels.sign_bits(xb, block=32, **PALLAS), bitops.pack(xb < 0, 1))


def test_sign_pack_reproduces_scaled_sign():
  x = mixed(300, 5, specials=False)
  for block_size in (None, 64):
    payload, _ = commopt.scaled_sign(block_size).encode(x, None, None)
    scales, words = kernels.sign_pack(x, block_size)
    np.testing.assert_array_equal(words, payload["signs"])
    np.testing.assert_array_equal(scales, payload["scale"])


# --- error feedback fused with the sign encoding ------------------------------------


@pytest.mark.parametrize("n, block_size, block", [
    (1, None, 64), (257, None, 64), (257, 7, 64),
    pytest.param(1000, 32, 64, marks=pytest.mark.slow), (1000, 64, 64), (1000, 256, 64),
    pytest.param(4099, 256, 1024, marks=pytest.mark.slow), (300, 512, 1024), (300, 300, 1024)])
def test_sign_feedback_is_the_separate_steps_bit_for_bit(n, block_size, block):
  """One pass where each scale block fits a program (32 <= block_size <= block, a power of
  two), two otherwise; either way the reference's bits, which are sign_pack of u + e and
  u + e minus scaled_sign's decode."""
  u, e = mixed(n, n, specials=False), mixed(n, n + 1, specials=False) / 3
  want = kernels.sign_feedback(u, e, block_size, implementation="xla", block=block)
  got = jax.jit(lambda u, e: kernels.sign_feedback(u, e, block_size, block=block, **PALLAS))(u, e)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  c = commopt.scaled_sign(block_size)
  p = u + e
  payload, _ = c.encode(p, None, None)
  np.testing.assert_array_equal(want[0], payload["scale"])
  np.testing.assert_array_equal(want[1], payload["signs"])
  np.testing.assert_array_equal(want[2], p - c.decode(payload, None, p))


def test_sign_feedback_checks_its_arguments():
  with pytest.raises(ValueError, match=r"`e` must be float32, got dtype bfloat16"):
    kernels.sign_feedback(jnp.ones(4), jnp.ones(4, jnp.bfloat16))
  with pytest.raises(ValueError, match=r"same, non-zero number of elements, got 4 and 3"):
    kernels.sign_feedback(jnp.ones(4), jnp.ones(3))


@pytest.mark.parametrize("block_size", [None, 256])
@pytest.mark.parametrize("impl", [("xla", False),
                                  pytest.param(("pallas", True), marks=pytest.mark.slow)])
def test_compressed_mean_fuses_error_feedback_bit_for_bit(block_size, impl):
  """compressed_mean(scaled_sign) runs encode_feedback (one fused op) where the residual
  and the update are float32; its means and residuals equal the separate steps'. Eight
  workers as a vmap over a named axis (the Pallas interpreter does not type its loads as
  varying inside a checked shard_map; natively the kernels run there, see
  test_kernels_native.py)."""
  import dataclasses
  compressor = commopt.scaled_sign(block_size)
  assert "fused_feedback" in compressor.capabilities
  calls = []
  fused = dataclasses.replace(compressor, encode_feedback=lambda *a: (
      calls.append(1), compressor.encode_feedback(*a))[1])
  separate = dataclasses.replace(compressor, encode_feedback=None)
  # Each step's gradients are inputs: an update computed in the program (g * 3) could be
  # contracted into a fused multiply-add with the residual's add by XLA on one path only.
  grads = [{"w": mixed(8000, i, specials=False).reshape(8, 1000) * (i + 1),
            "b": mixed(320, i + 5, specials=False).reshape(8, 40)} for i in range(3)]

  def run(compressor):
    tx = commopt.compressed_mean(compressor, axis_name="data", min_size=16)

    def steps(gs):
      state = tx.init(gs[0])
      outs = []
      for g in gs:
        out, state = tx.update(g, state)
        outs.append(out)
      return outs, state.residual

    with kernels.implementation(impl[0], interpret=impl[1]):
      return jax.jit(jax.vmap(steps, axis_name="data"))(grads)

  jax.tree.map(np.testing.assert_array_equal, run(fused), run(separate))
  assert calls   # the fused op ran


# --- stochastic quantise + pack ---------------------------------------------------


def _quantize_inputs(n, block_size, seed, norm=True):
  x = mixed(n, seed, specials=False)
  r = jax.random.bits(jax.random.key(seed), (n,), jnp.uint32)
  size = n if block_size is None else min(block_size, n)
  blocks = jnp.pad(x, (0, -(-n // size) * size - n)).reshape(-1, size)
  scales = jnp.linalg.norm(blocks, axis=1) if norm else jnp.max(jnp.abs(blocks), axis=1)
  return x, r, scales.at[0].set(0.0) if scales.size > 1 else scales


@pytest.mark.parametrize("levels, n, block_size", [(1, 100, None), (7, 257, 48), (127, 130, 7)])
def test_quantize_pack_qsgd_matches_the_reference(levels, n, block_size):
  x, r, scales = _quantize_inputs(n, block_size, levels + n)
  want = kernels.quantize_pack(x, r, levels, scales, block_size=block_size, implementation="xla")
  got = kernels.quantize_pack(x, r, levels, scales, block_size=block_size, block=64, **PALLAS)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n, block_size", [(100, None), (257, 64)])
def test_quantize_pack_terngrad_matches_the_reference(n, block_size):
  x, r, scales = _quantize_inputs(n, block_size, n, norm=False)
  x = x.at[3].set(jnp.nan)
  kw = {"block_size": block_size, "style": "terngrad"}
  want = kernels.quantize_pack(x, r, 1, scales, implementation="xla", **kw)
  got = kernels.quantize_pack(x, r, 1, scales, block=32, **PALLAS, **kw)
  np.testing.assert_array_equal(got, want)
  assert int(kernels.unpack_bits(got, 2, n)[3]) == 0   # NaN: level 0


@pytest.mark.slow
def test_quantize_pack_reproduces_qsgd_and_terngrad():
  """The reference fed the compressors' random words (the counter hash) is their encoding."""
  x = mixed(1000, 11, specials=False)
  key = jax.random.key(4)
  r = rng.counter_bits(key, 1000)
  payload, _ = commopt.qsgd(levels=7, bucket_size=128).encode(x, None, key)
  np.testing.assert_array_equal(
      kernels.quantize_pack(x, r, 7, payload["norms"], block_size=128), payload["codes"])
  payload, _ = commopt.compressors.terngrad(clip=None).encode(x, None, key)
  np.testing.assert_array_equal(
      kernels.quantize_pack(x, r, 1, payload["scale"], style="terngrad"), payload["codes"])


def test_uniform_from_bits_is_jax_random_uniform():
  key = jax.random.key(7)
  np.testing.assert_array_equal(
      kernels.uniform_from_bits(jax.random.bits(key, (513,), jnp.uint32)),
      jax.random.uniform(key, (513,), jnp.float32))


# --- top-k ------------------------------------------------------------------------


brute_top_k = commopt.testing.checks.top_k_indices


@pytest.mark.parametrize("n, k", [(1, 1), (100, 7), (257, 1), (257, 256), (257, 257)])
def test_select_top_k_matches_the_reference(n, k):
  """Ties, ±0, ±inf and NaN mixed in; sizes not multiples of the 32-element block."""
  x = mixed(n, n + k)
  values, indices = kernels.select_top_k(x, k, block=32, **PALLAS)
  want_values, want_indices = kernels.select_top_k(x, k, implementation="xla")
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(indices, brute_top_k(x, k))
  np.testing.assert_array_equal(values, want_values)      # NaN == NaN here
  assert values.dtype == x.dtype and indices.dtype == jnp.int32


@given(seed=st.integers(0, 2**31), k=st.sampled_from([5, 60]), radix_bits=st.sampled_from([3, 8]))
@settings(max_examples=8)
def test_select_top_k_property(seed, k, radix_bits):
  x = mixed(90, seed)
  _, indices = kernels.select_top_k(x, k, block=32, radix_bits=radix_bits, **PALLAS)
  np.testing.assert_array_equal(indices, brute_top_k(x, k))


def test_select_top_k_all_equal_and_bf16():
  """All ties: the first k indices. bf16 ranks by its float32 value."""
  x = -jnp.ones((3, 30))
  np.testing.assert_array_equal(kernels.select_top_k(x, 40, block=32, **PALLAS)[1], np.arange(40))
  xb = mixed(70, 2).astype(jnp.bfloat16)
  values, indices = kernels.select_top_k(xb, 9, block=32, **PALLAS)
  np.testing.assert_array_equal(indices, brute_top_k(xb.astype(jnp.float32), 9))
  assert values.dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("n, k", [(131_072, 1), (131_075, 131), (200_003, 2_000),
                                  (300_007, 30_000)])
def test_select_top_k_sampled_bracket_and_fallback(n, k):
  """Large leaves: a sample bounds the k-th key, two passes count and write the candidates,
  the k largest are found among them (indices ascending). A leaf the sample misjudges (all
  ties) falls back to the radix select. Both give the reference's coordinates."""
  from commopt.kernels.select import pallas as select_pallas
  x = mixed(n, n + k)
  assert select_pallas.suits_sampled(n, k)
  low, counts, total, bracketed = select_pallas.sampled_bound(x, k, 1024)
  assert bool(bracketed), (int(total), k, select_pallas.sampled_capacity(n, k))
  np.testing.assert_array_equal(total, np.sum(np.asarray(kernels.magnitude_key(x)) >= int(low)))
  values, indices = kernels.select_top_k(x, k, block=1024, **PALLAS)
  want_values, want_indices = kernels.select_top_k(x, k, implementation="xla")
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_array_equal(values, want_values)
  ties = jnp.ones(n).at[n // 3].set(2.0)
  assert not bool(select_pallas.sampled_bound(ties, k, 1024)[3])
  np.testing.assert_array_equal(kernels.select_top_k(ties, k, block=1024, **PALLAS)[1],
                                brute_top_k(ties, k))


@pytest.mark.slow   # each mask length compiles anew: 19 s; the edges below stay in the default tier
@given(mask=st.lists(st.booleans(), min_size=0, max_size=200),
       extra=st.integers(min_value=0, max_value=5), take=st.floats(0.0, 1.0))
def test_first_true_is_the_first_true_indices(mask, extra, take):
  """The word-scan compaction against numpy on any mask up to 200 entries (no true entry
  included) with capacities below, at and past the count (empty slots hold n)."""
  from commopt._src import base
  mask = np.asarray(mask, bool)
  count = int(mask.sum())
  for capacity in (int(take * count), count, count + extra):
    want = np.flatnonzero(mask)[:capacity]
    want = np.concatenate([want, np.full(capacity - want.size, mask.size)])
    got = base.first_true(jnp.asarray(mask), capacity)
    assert got.dtype == jnp.int32 and got.shape == (capacity,)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("n", [32] + [pytest.param(n, marks=pytest.mark.slow)
                                        for n in (31, 33, 63, 64, 65)])
def test_first_true_at_word_edges_and_under_vmap(n):
  """Masks that end just before, at and after a word's end, as one and as a batch."""
  from commopt._src import base
  rng = np.random.default_rng(n)
  masks = np.stack([rng.random(n) < d for d in (0.0, 0.1, 0.5, 1.0)])
  masks[1, -1] = True                                 # the last entry of the last word
  want = lambda m, c: np.concatenate([np.flatnonzero(m)[:c],
                                      np.full(max(0, c - m.sum()), n)]).astype(np.int32)
  for capacity in (1, n // 2, n, n + 2):
    got = jax.vmap(lambda m: base.first_true(m, capacity))(jnp.asarray(masks))
    for m, g in zip(masks, np.asarray(got)):
      np.testing.assert_array_equal(g, want(m, capacity))


@pytest.mark.parametrize("n, block", [(1, 32), pytest.param(95, 32, marks=pytest.mark.slow),
                                      pytest.param(1000, 64, marks=pytest.mark.slow),
                                      pytest.param(70_001, 1024, marks=pytest.mark.slow)])
def test_first_true_matches_the_reference(n, block):
  """The two-pass compaction gives the scan's indices; empty slots hold n."""
  from commopt._src import base
  rng = np.random.default_rng(n)
  for density in (0.0, 0.05, 1.0):
    mask = jnp.asarray(rng.random(n) < density)
    for capacity in (0, 1, max(1, n // 10), n, n + 3):
      got = kernels.first_true(mask, capacity, block=block, **PALLAS)
      np.testing.assert_array_equal(got, base.first_true(mask, capacity))
      assert got.dtype == jnp.int32 and got.shape == (capacity,)
  with pytest.raises(ValueError, match="`mask` must be a boolean array, got float32"):
    kernels.first_true(jnp.ones(3), 1)
  with pytest.raises(ValueError, match="`capacity` must be a non-negative integer, got -1"):
    kernels.first_true(jnp.ones(3, bool), -1)


def test_select_top_k_nan_is_the_largest_magnitude():
  x = jnp.array([1.0, jnp.nan, -jnp.inf, 3.0, 0.0])
  for options in (PALLAS, {"implementation": "xla"}):
    values, indices = jax.jit(lambda v: kernels.select_top_k(v, 2, **options))(x)
    assert indices.tolist() == [1, 2] and np.isnan(values[0]) and values[1] == -np.inf



# --- one summation order, one index order -----------------------------------------


def test_pairwise_sum_is_the_aligned_binary_tree():
  """Neighbours are added level by level; the last axis is zero-padded to a power of two."""
  v = np.random.default_rng(0).standard_normal((3, 13)).astype(np.float32) * 1e4
  tree = np.pad(v, ((0, 0), (0, 3)))
  while tree.shape[1] > 1:
    tree = tree[:, 0::2] + tree[:, 1::2]
  np.testing.assert_array_equal(kernels.pairwise_sum(jnp.asarray(v)), tree[:, 0])
  np.testing.assert_array_equal(jax.jit(kernels.pairwise_sum)(jnp.asarray(v)), tree[:, 0])
  assert kernels.pairwise_sum(jnp.zeros((2, 0))).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("n, block_size", [
    (100, None), (257, 48), (257, 7), pytest.param(5000, 300, marks=pytest.mark.slow),
    (20000, None), pytest.param(20000, 1024, marks=pytest.mark.slow)])
def test_sign_pack_scales_are_bit_identical_whatever_the_implementation_and_block(n, block_size):
  """Every block's magnitudes are added in one order, that of pairwise_sum over the block."""
  x = mixed(n, n, specials=False) * 100.0
  want_scales, want_words = jax.jit(
      lambda v: kernels.sign_pack(v, block_size, implementation="xla"))(x)
  blocks = np.pad(np.abs(np.asarray(x)), (0, -n % (block_size or n)))
  sums = kernels.pairwise_sum(jnp.asarray(blocks.reshape(-1, block_size or n)))
  np.testing.assert_array_equal(
      want_scales, jax.jit(lambda s: s / commopt._src.base.block_counts(n, block_size))(sums))
  for block in (32, 256, 8192):
    scales, words = jax.jit(lambda v: kernels.sign_pack(v, block_size, block=block, **PALLAS))(x)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(words, want_words)
    xla = jax.jit(lambda v: kernels.sign_pack(v, block_size, block=block, implementation="xla"))
    np.testing.assert_array_equal(xla(x)[0], want_scales)


def test_select_top_k_approx_is_exact_off_tpu_and_checks_its_arguments():
  x = mixed(300, 9)
  for options in (PALLAS, {"implementation": "xla"}):
    _, indices = kernels.select_top_k(x, 20, approx=True, recall_target=0.5, **options)
    np.testing.assert_array_equal(indices, brute_top_k(x, 20))
  with pytest.raises(ValueError, match=r"`recall_target` must be a number in \(0, 1\], got 0"):
    kernels.select_top_k(x, 2, recall_target=0)
  with pytest.raises(ValueError, match=r"`approx` must be True or False, got 'yes'"):
    kernels.select_top_k(x, 2, approx="yes")


# --- the implementation scope ------------------------------------------------------


@OFF_GPU
def test_a_scope_picks_the_implementation_of_every_op_called_without_one():
  x = mixed(100, 1, specials=False)
  codes = jnp.arange(100, dtype=jnp.uint32) % 4
  ops = [lambda: kernels.pack_bits(codes, 2), lambda: kernels.unpack_bits(codes, 2, 100),
         lambda: kernels.sign_pack(x), lambda: kernels.select_top_k(x, 5),
         lambda: kernels.quantize_pack(x, codes, 1, jnp.ones(1))]

  def pallas(op):
    # A new function each time: the scope is read when the op is traced, and
    # make_jaxpr (as jit) reuses the trace of a function it has seen.
    return "pallas_call" in str(jax.make_jaxpr(lambda: op())())

  for op in ops:
    assert not pallas(op)
    with kernels.implementation("pallas", interpret=True):
      assert pallas(op)
      with kernels.implementation("xla"):
        assert not pallas(op)
      assert pallas(op)
    with kernels.implementation("auto", interpret=True):
      assert pallas(op)
    assert not pallas(op)


@OFF_GPU
def test_explicit_arguments_win_over_the_scope():
  codes = jnp.arange(64, dtype=jnp.uint32) % 16
  with kernels.implementation("pallas", interpret=True):
    jaxpr = str(jax.make_jaxpr(lambda: kernels.pack_bits(codes, 4, implementation="xla"))())
    assert "pallas_call" not in jaxpr
    # interpret=False with a scope's "pallas" off a GPU: the kernel cannot run.
    with pytest.raises(ValueError, match=r"needs a GPU backend"):
      kernels.pack_bits(codes, 4, interpret=False)
  with kernels.implementation("xla"):
    jaxpr = str(jax.make_jaxpr(lambda: kernels.pack_bits(codes, 4, **PALLAS))())
    assert "pallas_call" in jaxpr


# --- capability check --------------------------------------------------------------


def test_info_says_what_auto_runs_and_why():
  facts = kernels.info()
  assert facts["backend"] == jax.default_backend()
  assert (facts["native"] == "triton") == (facts["auto_runs"] == "pallas (triton)")
  assert facts["reason"] and facts["mosaic_gpu"]["used"] is False
  with kernels.implementation("xla"):
    assert kernels.info()["scope"] == {"implementation": "xla", "interpret": False}


def test_a_gpu_without_the_triton_lowering_runs_the_references(monkeypatch, caplog):
  """One capability check decides: 'auto' falls back to the reference and logs why, once;
  an explicit 'pallas' raises with the reason."""
  from commopt.kernels import _dispatch
  facts = dict(_dispatch.capabilities(), backend="gpu", native=None,
               reason="this JAX has no Pallas Triton lowering")
  monkeypatch.setattr(_dispatch, "capabilities", lambda backend=None: facts)
  monkeypatch.setattr(_dispatch, "_WARNED", set())
  x = jnp.array([1.0, -2.0, 3.0])
  with caplog.at_level("WARNING", logger="commopt.kernels"):
    for _ in range(2):
      scale, words = kernels.sign_pack(x)
  assert words.tolist() == [2] and scale == 2.0
  logged = [r.getMessage() for r in caplog.records if "sign_pack" in r.getMessage()]
  assert logged == ["commopt.kernels.sign_pack runs its reference: "
                    "this JAX has no Pallas Triton lowering."]
  assert kernels.info()["auto_runs"] == "xla reference"
  with pytest.raises(ValueError, match="cannot run here: this JAX has no Pallas Triton"):
    kernels.sign_pack(x, implementation="pallas")


@pytest.mark.slow
def test_the_gpu_benchmark_section_runs_through_the_interpreter():
  """benchmarks/kernels.py's GPU rows, off a GPU: every row present, the sampled select's
  bound held (its times mean nothing here)."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  import kernels as bench
  rows = bench.gpu_rows([140_000], 1, interpret=True)
  ops = {(r["op"], r["impl"]) for r in rows}
  assert {("sign_pack", "pallas"), ("sign_pack", "xla"), ("quantize_pack(qsgd, 7)", "pallas"),
          ("first_true(1%)", "pallas"),
          ("top-k 1.0%", "select_top_k pallas"), ("top-k 0.1%", "lax.top_k")} <= ops
  assert all(r["bracketed"] for r in rows if r["impl"] == "select_top_k pallas")
  assert all(r["ms"] > 0 for r in rows)
