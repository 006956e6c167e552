"""Every compressor's payload is the same bits whichever kernel implementation encoded it.

One test class, parametrised over the implementations of :mod:`commopt.kernels`
(bound with :func:`commopt.kernels.implementation`); each of its tests compares
what the bound implementation gives with what the pure-jnp reference
(``"xla"``) gives: payloads, decodes and states bit for bit. On CPU the Pallas
kernels run through the Pallas interpreter; on a GPU ``"auto"`` runs them
compiled.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from commopt import kernels
from commopt._src import base
from commopt.compressors import (
    REGISTRY,
    adaptive_levels,
    int_quant,
    make,
    qsgd,
    scaled_sign,
    sign,
    terngrad,
    top_k,
)

REFERENCE = "xla"
IMPLEMENTATIONS = {
    "xla": {"name": "xla"},
    "pallas": {"name": "pallas", "interpret": True},
    "auto": {"name": "auto"},
}
SHAPE = (37, 29)   # 1073 coordinates: not a multiple of a word, a block or a chunk

# Registered names whose encoder reaches a Pallas kernel at the DEFAULTS options.
REACHES_PALLAS = {"scaled_sign", "sign", "onebit", "terngrad", "qsgd", "int_quant",
                  "adaptive_levels", "top_k", "natural", "sketchml", "sketch_sgd",
                  # the compaction of a mask (kernels.first_true)
                  "atomo", "gradient_dropping", "threshold", "variance_balanced"}


def _case(factory, dtype=jnp.float32, pallas=True):
  return factory, dtype, pallas


CASES = {name: _case(functools.partial(make, name), pallas=name in REACHES_PALLAS)
         for name in sorted(REGISTRY)}
CASES.update({
    "top_k(scope=global)": _case(lambda: top_k(0.01, scope="global")),
    "top_k(k=64)": _case(lambda: top_k(k=64)),
    "top_k(approx)": _case(lambda: top_k(0.05, approx=True)),
    "top_k(bf16 in, bf16 values)": _case(lambda: top_k(0.05, value_dtype="bfloat16"),
                                         jnp.bfloat16),
    "int_quant(bits=4)": _case(lambda: int_quant(bits=4)),
    "int_quant(bits=8, nearest, one block)": _case(
        lambda: int_quant(bits=8, block_size=None, rounding="nearest")),
    "int_quant(bits=4, block_size=48)": _case(lambda: int_quant(bits=4, block_size=48)),
    "qsgd(levels=1, one bucket)": _case(lambda: qsgd(levels=1, bucket_size=None)),   # 2 bits
    "qsgd(levels=127)": _case(lambda: qsgd(levels=127, bucket_size=100)),           # 8 bits
    "qsgd(levels=3)": _case(lambda: qsgd(levels=3), pallas=False),                  # 3 bits
    "scaled_sign(block_size=48)": _case(lambda: scaled_sign(block_size=48)),
    "scaled_sign(bf16)": _case(scaled_sign, jnp.bfloat16),
    "sign(bf16)": _case(sign, jnp.bfloat16),
    "terngrad(clip=None)": _case(lambda: terngrad(clip=None)),
    "adaptive_levels(levels=4)": _case(lambda: adaptive_levels(levels=4)),          # 2 bits
    "adaptive_levels(levels=256)": _case(lambda: adaptive_levels(levels=256)),      # 8 bits
    "adaptive_levels(levels=8)": _case(lambda: adaptive_levels(levels=8), pallas=False),
})


def leaf(seed=0, shape=SHAPE, dtype=jnp.float32):
  """Gaussian values with zeros, exact ties and a few large outliers mixed in."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape).astype(np.float32)
  x[rng.random(shape) < 0.2] = 0.0
  ties = rng.random(shape) < 0.2
  x[ties] = rng.integers(-2, 3, int(ties.sum())).astype(np.float32)
  x.reshape(-1)[rng.choice(x.size, 5, replace=False)] *= 1e3
  return jnp.asarray(x, dtype)


def same_bits(got, want, what):
  """``got`` and ``want`` are pytrees of the same structure, shapes, dtypes and bytes."""
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree, what
  for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, i, a.dtype, a.shape, b.dtype, b.shape)
    if a.tobytes() != b.tobytes():
      diff = np.flatnonzero(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8))
      raise AssertionError(f"{what}: leaf {i} differs in {diff.size} bytes, first at {diff[0]}")


def run(implementation, fn, *args):
  """``jax.jit(fn)(*args)`` traced and run under ``implementation``."""
  with kernels.implementation(**IMPLEMENTATIONS[implementation]):
    return jax.jit(fn)(*args)


def encode_decode(c, x, key):
  state = c.init(x)
  payload, new_state = c.encode(x, state, key)
  return payload, new_state, c.decode(payload, new_state, x)


@functools.lru_cache(maxsize=None)
def reference(case):
  factory, dtype, _ = CASES[case]
  c = factory()
  return run(REFERENCE, functools.partial(encode_decode, c), leaf(dtype=dtype),
             jax.random.key(3))


# In the slow tier: the cases whose encoder reaches no kernel (the same program under every
# implementation off GPUs) and the three that interpret longest (6-10 s each on 2 cores).
SLOW_CASES = {c for c, (_, _, pallas) in CASES.items() if not pallas} | {
    "sketch_sgd", "sketchml", "adaptive_levels(levels=256)"}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
class TestPayloadBackends:
  """The bound implementation against the reference."""

  @pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES
                                    else c for c in sorted(CASES)])
  def test_payload_state_and_decode_are_the_references(self, implementation, case):
    if implementation == REFERENCE or (implementation == "auto"
                                       and jax.default_backend() != "gpu"):
      pytest.skip("runs the reference itself on this backend")
    factory, dtype, _ = CASES[case]
    c = factory()
    x = leaf(dtype=dtype)
    got = run(implementation, functools.partial(encode_decode, c), x, jax.random.key(3))
    same_bits(got, reference(case), f"{case} under {implementation!r}")
    # The payload is what payload_bits says, whichever implementation packed it.
    bits = sum(v.size * base.dtype_bits(v.dtype) for v in jax.tree.leaves(got[0]))
    assert bits == c.payload_bits(x.shape, x.dtype), case

  @pytest.mark.parametrize("case", sorted(CASES))
  def test_the_bound_implementation_is_the_one_that_runs(self, implementation, case):
    factory, dtype, pallas = CASES[case]
    c = factory()
    x = leaf(dtype=dtype)
    with kernels.implementation(**IMPLEMENTATIONS[implementation]):
      jaxpr = str(jax.make_jaxpr(functools.partial(encode_decode, c))(x, jax.random.key(3)))
    on_pallas = implementation == "pallas" or (implementation == "auto"
                                               and jax.default_backend() == "gpu")
    assert ("pallas_call" in jaxpr) == (pallas and on_pallas), (case, implementation)

  @pytest.mark.parametrize("case", ["top_k(scope=global)"])
  def test_tree_wide_selection(self, implementation, case):
    c = CASES[case][0]()
    xs = [leaf(1), leaf(2, (300,)), leaf(3, (5, 7))]

    def encode_decode_tree(xs, key):
      payload = c.encode_tree(xs, key)
      return payload, c.decode_tree(payload, xs)

    got = run(implementation, encode_decode_tree, xs, jax.random.key(0))
    want = run(REFERENCE, encode_decode_tree, xs, jax.random.key(0))
    same_bits(got, want, f"{case} encode_tree under {implementation!r}")
    assert got[0]["indices"].shape == (sum(-(-x.size // 100) for x in xs),)
    assert bool(jnp.all(jnp.diff(got[0]["indices"]) > 0))

  @pytest.mark.parametrize("case", ["int_quant(bits=4)", "qsgd", "scaled_sign(block_size=48)",
                                    "terngrad", "top_k(k=64)"])
  def test_under_vmap(self, implementation, case):
    """Several workers' encodes and decodes at once, as the reductions run them."""
    factory, dtype, _ = CASES[case]
    c = factory()
    xs = jnp.stack([leaf(s, (300,), dtype) for s in range(3)])
    keys = jax.random.split(jax.random.key(5), 3)

    def many(xs, keys):
      return jax.vmap(lambda x, k: encode_decode(c, x, k))(xs, keys)

    same_bits(run(implementation, many, xs, keys), run(REFERENCE, many, xs, keys),
              f"{case} under vmap and {implementation!r}")


def test_top_k_indices_are_ascending_on_every_implementation():
  """The canonical order: a payload's indices are sorted, whoever selected them."""
  x = leaf(7)
  c = top_k(k=40)
  for implementation in IMPLEMENTATIONS:
    payload, _, _ = run(implementation, functools.partial(encode_decode, c), x, None)
    indices = np.asarray(payload["indices"])
    assert np.all(np.diff(indices) > 0), implementation
    want = np.argsort(-np.abs(np.asarray(x).reshape(-1)), kind="stable")[:40]
    np.testing.assert_array_equal(indices, np.sort(want))


def test_the_scope_is_read_when_tracing_and_restored_after():
  assert kernels.current() == kernels.Choice("auto", False)
  with kernels.implementation("pallas", interpret=True) as choice:
    assert choice == kernels.current() == kernels.Choice("pallas", True)
    with kernels.implementation("xla"):
      assert kernels.current().implementation == "xla"
      assert not kernels.use_pallas(None, None, "f")
    assert kernels.use_pallas(None, None, "f")
    # A scope's "pallas" falls back where the kernel does not apply; an explicit one raises.
    assert not kernels.use_pallas(None, None, "f", "packs only (1, 2, 4, 8) bits")
    codes = jnp.arange(40, dtype=jnp.uint32) % 8
    np.testing.assert_array_equal(kernels.pack_bits(codes, 3),
                                  kernels.pack_bits(codes, 3, implementation="xla"))
    with pytest.raises(ValueError, match=r"packs only \(1, 2, 4, 8\) bits per code, got bits=3"):
      kernels.pack_bits(codes, 3, implementation="pallas")
    # Explicit arguments win over the scope.
    assert not kernels.use_pallas("xla", None, "f")
  assert kernels.current() == kernels.Choice("auto", False)


@pytest.mark.parametrize("call, error, match", [
    (lambda: kernels.implementation("gpu"), ValueError,
     r"implementation: `implementation` must be one of \('auto', 'xla', 'pallas'\), got 'gpu'"),
    (lambda: kernels.implementation("pallas", interpret="yes"), ValueError,
     r"`interpret` must be True or False, got 'yes'"),
])
def test_scope_errors_name_the_argument(call, error, match):
  with pytest.raises(error, match=match):
    with call():
      pass


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the check is for hosts without a GPU")
def test_a_pallas_scope_without_interpret_off_gpu_says_how_to_run_it():
  with kernels.implementation("pallas"):
    with pytest.raises(ValueError, match=r"needs a GPU backend, got 'cpu'.*interpret=True"):
      kernels.sign_bits(jnp.ones(4))
