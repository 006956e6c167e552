"""The checks every compressor passes, as functions you can run on your own.

Each check builds :func:`~commopt.compressed_mean` (or a wrapper around it)
on a small parameter tree (a ``64×48`` matrix, a 16-element vector and a
``None`` leaf), runs it, and raises ``AssertionError`` saying what failed.
:func:`run_all` runs every check that applies to a compressor; the
registered compressors pass it in ``tests/test_compressor_suite.py``, and a
compressor of your own can be held to the same bar::

    from commopt.testing import checks
    mesh = jax.make_mesh((8,), ("data",))
    checks.run_all(my_compressor(), mesh)

What is checked:

- :func:`declared_capabilities`: ``stateful`` and ``linear`` hold as declared.
- :func:`jit_without_retrace`: ``update`` jits once and returns finite values,
  ``None`` leaves stay ``None``.
- :func:`dtypes_and_none_leaves`: f32 and bf16 leaves keep their dtype and
  shape, and the reconstruction points the way of the input.
- :func:`vmap_equals_shard_map`: simulated workers on one device equal one
  worker per device, over three steps, states included.
- :func:`one_device_equals_local`: a one-device mesh equals ``axis_name=None``.
- :func:`error_feedback_conservation`: over six steps, the outputs plus the
  mean residual equal the mean inputs.
- :func:`payload_bytes_equal_hlo_audit`: :func:`commopt.wire.payload_bytes`
  equals the bytes of the compiled program's collectives.
- :func:`cond_state_stability`: the state keeps its types through
  ``lax.cond`` (what optax's wrappers, ``apply_if_finite`` among them, need).
- :func:`multi_steps_accumulates`: inside :func:`commopt.multi_steps`, the
  emitted update is the transform applied to the mean of the accumulated inputs.
- :func:`chunked_strategies`: ``two_phase`` and ``hierarchical`` run and
  conserve (stateless per-leaf compressors only).
- :func:`robust_rule_compatible`: a robust rule decodes each worker's payload
  (stateless per-leaf compressors only).
- :func:`option_types`: a registered factory refuses options of the wrong
  type when it is called, naming the option.
"""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from commopt import wire
from commopt._src import base
from commopt.aggregators import coordinate_median
from commopt.testing._workers import shard_map_workers, vmap_workers
from commopt.transforms import compressed_mean, multi_steps

__all__ = [
    "SPECIAL_FLOATS",
    "chunked_strategies",
    "cond_state_stability",
    "declared_capabilities",
    "dtypes_and_none_leaves",
    "error_feedback_conservation",
    "fused_sum_equals_reference",
    "hard_floats",
    "jit_without_retrace",
    "multi_steps_accumulates",
    "one_device_equals_local",
    "option_types",
    "owed",
    "params_like",
    "payload_bytes_equal_hlo_audit",
    "robust_rule_compatible",
    "run_all",
    "top_k_indices",
    "vmap_equals_shard_map",
    "worker_updates",
]

MIN_SIZE = 256
"""The checks' ``min_size``: the matrix is compressed, the vector sent dense."""


SPECIAL_FLOATS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -3.0, 3.0],
                          np.float32)
"""Signed zeros, infinities, NaNs of both signs, a denormal and a tie pair."""


def hard_floats(n: int, seed: int, specials: bool = True, dtype=jnp.float32) -> jax.Array:
  """``n`` values that break careless encoders: Gaussian with many exact ties
  (30% drawn from -2..2) and, with ``specials``, each of :data:`SPECIAL_FLOATS`
  once at a random place. Seeded, so a failure reproduces."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(n).astype(np.float32)
  ties = rng.random(n) < 0.3
  x[ties] = rng.integers(-2, 3, int(ties.sum())).astype(np.float32)
  if specials:
    where = rng.choice(n, size=min(n, SPECIAL_FLOATS.size), replace=False)
    x[where] = SPECIAL_FLOATS[:where.size]
  return jnp.asarray(x).astype(dtype)


def top_k_indices(x, k: int) -> np.ndarray:
  """The ``k`` indices any magnitude top-k of ``x`` must select, ascending, in numpy.

  The rule of :func:`commopt.kernels.select_top_k`: largest ``|x|`` bit
  patterns first (NaN above inf, ``-0.0`` tied with ``0.0``), the lower index
  on ties.
  """
  key = np.asarray(x, np.float32).view(np.uint32) & 0x7FFFFFFF
  order = np.lexsort((np.arange(key.size), -key.astype(np.int64)))
  return np.sort(order[:k])


def params_like(dtype=jnp.float32):
  """A compressible matrix, a small dense vector and a ``None`` leaf."""
  return {"w": jnp.zeros((64, 48), dtype), "b": jnp.zeros((16,), dtype), "frozen": None}


def worker_updates(seed: int, dtype=jnp.float32, n: int = 8):
  """Normal updates for ``n`` workers, stacked on a leading axis, shaped like :func:`params_like`."""
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(n, 64, 48)), dtype),
          "b": jnp.asarray(rng.normal(size=(n, 16)), dtype), "frozen": None}


def _first(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _tx(compressor, axis_name=None, **kw):
  """``compressed_mean`` with a residual wherever one is sound (the error-feedback path:
  ``C/(1+ω)`` for an unbiased compressor), so the checks exercise it."""
  kept = compressor.error_kind not in ("direction", "lossless")
  kw.setdefault("error_feedback", True if kept else "auto")
  return compressed_mean(compressor, axis_name=axis_name, min_size=MIN_SIZE, **kw)


def _residual(state, key, like) -> np.ndarray:
  """The stacked residual of leaf ``key`` as float32, zeros where none is kept."""
  r = state.residual[key]
  if isinstance(r, optax.MaskedNode):
    return np.zeros(np.shape(like), np.float32)
  return np.asarray(r, np.float32)


def _workers(mesh) -> int:
  return int(np.prod(mesh.devices.shape))


def declared_capabilities(compressor: base.Compressor) -> None:
  """What the compressor declares holds: ``stateful`` iff ``init`` returns state, and a
  ``linear`` compressor's summed payloads decode to the sum of its reconstructions."""
  like = params_like()["w"]
  state = compressor.init(like)
  has_state = bool(jax.tree.leaves(state))
  assert has_state == compressor.stateful, (
      f"{compressor.name}: declares stateful={compressor.stateful}, but init returns "
      f"{'some' if has_state else 'no'} state")
  if compressor.linear and compressor.reduce is None:
    key = jax.random.PRNGKey(3)
    xs = [_first(worker_updates(70 + i))["w"] for i in range(2)]
    payloads = [compressor.encode(x, state, key)[0] for x in xs]
    summed = compressor.decode(jax.tree.map(jnp.add, *payloads), state, like)
    apart = sum(compressor.decode(p, state, like).astype(jnp.float32) for p in payloads)
    np.testing.assert_allclose(np.asarray(summed, np.float32), np.asarray(apart), rtol=1e-2,
                               atol=1e-2, err_msg=f"{compressor.name} declares linear")


def jit_without_retrace(compressor: base.Compressor) -> None:
  """``update`` traces once for two calls, returns finite values and keeps ``None`` leaves."""
  tx = _tx(compressor)
  traces = []

  @jax.jit
  def step(u, s):
    traces.append(1)
    return tx.update(u, s)

  state = tx.init(params_like())
  u = _first(worker_updates(0))
  out, state = step(u, state)
  out, state = step(jax.tree.map(lambda x: x + 1.0, u), state)
  assert len(traces) == 1, f"{compressor.name}: update traced {len(traces)} times for 2 calls"
  assert out["frozen"] is None, f"{compressor.name}: a None leaf came back as {out['frozen']!r}"
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out)), (
      f"{compressor.name}: non-finite output")


def dtypes_and_none_leaves(compressor: base.Compressor, dtype=jnp.float32) -> None:
  """Leaves of ``dtype`` keep dtype and shape; the matrix's output points the way of its input."""
  tx = _tx(compressor)
  state = tx.init(params_like(dtype))
  u = _first(worker_updates(1, dtype))
  out, state = jax.jit(tx.update)(u, state)
  assert out["frozen"] is None
  for key in ("w", "b"):
    assert out[key].dtype == dtype and out[key].shape == u[key].shape, (
        f"{compressor.name}: leaf {key!r} came back {out[key].dtype}{out[key].shape}, "
        f"expected {jnp.dtype(dtype)}{u[key].shape}")
    assert bool(jnp.all(jnp.isfinite(out[key].astype(jnp.float32))))
  cos = jnp.vdot(out["w"].astype(jnp.float32), u["w"].astype(jnp.float32))
  assert float(cos) > 0, f"{compressor.name}: the output points away from the input"


def vmap_equals_shard_map(compressor: base.Compressor, mesh, axis_name: str = "data", *,
                          atol: float = 1e-6) -> None:
  """Workers simulated with ``vmap`` equal one worker per device, for three steps.

  The mean of ``n`` reconstructions may be summed in another order by the two
  programs, which moves it by up to ``n`` float32 ulps of the largest
  reconstruction (an unbiased sparsifier sends ``x/p``, far larger than the
  mean it averages to). The tolerance is ``atol`` or that bound, whichever
  is larger. ``atol`` also allows for payloads whose sum rounds in a
  backend-specific order (a bf16 all-reduce sums in f32 on XLA:CPU and in
  bf16 under vmap).
  """
  n = _workers(mesh)
  tx = _tx(compressor, axis_name)
  vm = vmap_workers(tx, n, axis_name)
  sm = shard_map_workers(tx, mesh, axis_name)
  s_v, s_s = vm.init(params_like()), sm.init(params_like())
  eps = float(jnp.finfo(jnp.float32).eps)
  for step in range(3):
    u = worker_updates(10 + step, n=n)
    before = _residual(s_v, "w", u["w"])
    o_v, s_v = vm.update(u, s_v)
    o_s, s_s = sm.update(u, s_s)
    # Each worker's reconstruction: its compensated input less what it kept back.
    local = np.asarray(u["w"], np.float32) + before - _residual(s_v, "w", u["w"])
    tol = max(atol, n * eps * float(np.abs(local).max()))
    for a, b in zip(jax.tree.leaves((o_v, s_v)), jax.tree.leaves((o_s, s_s))):
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-5, atol=tol, err_msg=f"{compressor.name}, step {step}")
  o_s = np.asarray(o_s["w"])
  np.testing.assert_allclose(o_s, np.broadcast_to(o_s[0], o_s.shape), rtol=1e-6,
                             err_msg=f"{compressor.name}: workers received different means")


def one_device_equals_local(compressor: base.Compressor) -> None:
  """A one-device mesh gives what ``axis_name=None`` gives, for three steps."""
  mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  local = _tx(compressor)
  sm = shard_map_workers(_tx(compressor, "data"), mesh1, "data")
  s_l, s_s = local.init(params_like()), sm.init(params_like())
  for step in range(3):
    u = worker_updates(20 + step, n=1)
    o_s, s_s = sm.update(u, s_s)
    o_l, s_l = jax.jit(local.update)(_first(u), s_l)
    for a, b in zip(jax.tree.leaves(o_l), jax.tree.leaves(o_s)):
      np.testing.assert_allclose(a, np.asarray(b)[0], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{compressor.name}, step {step}")


def owed(state, key: str, n: int, mesh, axis_name, strategy: str = "auto") -> np.ndarray:
  """What error feedback still owes the mean for leaf ``key`` of ``n`` coordinates, flat ``[n]``.

  The mean over workers of their residuals, plus the server memories of
  ``two_phase`` (worker ``j`` holds chunk ``j``); under ``hierarchical`` a
  node's residual is its local ranks' shards end to end, and worker
  ``(s, l)`` holds chunk ``s`` of shard ``l`` of the server memory. Takes the
  state stacked over workers, as :func:`shard_map_workers` returns it.
  """
  if isinstance(state.residual[key], optax.MaskedNode):
    return np.zeros(n, np.float32)
  residual = np.asarray(state.residual[key], np.float32)
  server = state.server_residual[key] if state.server_residual is not None else None
  has_server = server is not None and not isinstance(server, optax.MaskedNode)
  if strategy == "hierarchical":
    nodes, ranks = (mesh.shape[a] for a in axis_name)
    total = residual.reshape(nodes, -1)[:, :n].mean(0)
    if has_server:
      shard = -(-n // ranks)
      parts = np.asarray(server, np.float32).reshape(nodes, ranks, -1)
      total = total + parts.transpose(1, 0, 2).reshape(ranks, -1)[:, :shard].reshape(-1)[:n]
    return total
  total = residual.reshape(residual.shape[0], -1).mean(0)
  if has_server:
    total = total + np.asarray(server, np.float32).reshape(-1)[:n]
  return total


def error_feedback_conservation(compressor: base.Compressor, mesh, axis_name="data", *,
                                strategy: str = "auto", atol: float = 1e-4) -> None:
  """Over six steps: Σ outputs + what is owed (:func:`owed`) = Σ mean inputs.

  Within ``atol``, plus float32 rounding of the magnitudes that went through
  the sums (a coordinate an unbiased sparsifier sent as ``x/p`` is large, and
  its rounding with it): ``64·eps32`` times the sum of every output's, the
  debt's and the inputs' magnitudes there.
  """
  n = _workers(mesh)
  sm = shard_map_workers(_tx(compressor, axis_name, strategy=strategy), mesh, axis_name)
  state = sm.init(params_like())
  sum_out = sum_in = magnitude = 0.0
  for step in range(6):
    u = worker_updates(30 + step, n=n)
    out, state = sm.update(u, state)
    o = np.asarray(out["w"], np.float32)[0].reshape(-1)
    i = np.asarray(u["w"], np.float32).mean(0).reshape(-1)
    sum_out, sum_in, magnitude = sum_out + o, sum_in + i, magnitude + np.abs(o) + np.abs(i)
  debt = owed(state, "w", sum_in.size, mesh, axis_name, strategy)
  error = np.abs(sum_out + debt - sum_in)
  bound = atol + 1e-4 * np.abs(sum_in) + 64 * np.finfo(np.float32).eps * (magnitude + np.abs(debt))
  worst = int(np.argmax(error - bound))
  assert np.all(error <= bound), (
      f"{compressor.name} ({strategy}): Σ out + owed − Σ in is {error[worst]:.3g} at "
      f"coordinate {worst}, above {bound[worst]:.3g}")


def payload_bytes_equal_hlo_audit(compressor: base.Compressor, mesh,
                                  axis_name: str = "data") -> None:
  """The compiled program's collectives carry exactly :func:`commopt.wire.payload_bytes`."""
  tx = _tx(compressor, axis_name)
  sm = shard_map_workers(tx, mesh, axis_name)
  u = worker_updates(40, n=_workers(mesh))
  collectives = wire.hlo_collectives(sm.update, u, sm.init(params_like()))
  expected = wire.payload_bytes(compressor, params_like(), min_size=MIN_SIZE)
  got = wire.total_bytes(collectives)
  assert got == expected.total, (
      f"{compressor.name}: the compiled step moves {got} bytes per worker, payload_bytes "
      f"says {expected.total}: {[c.line for c in collectives]}")


def cond_state_stability(compressor: base.Compressor) -> None:
  """``lax.cond(pred, update, keep)`` traces: the new state has the old one's types."""
  tx = _tx(compressor)
  state = tx.init(params_like())
  u = _first(worker_updates(2))

  @jax.jit
  def step(pred, u, s):
    return jax.lax.cond(pred, lambda: tx.update(u, s)[1], lambda: s)

  new = step(True, u, state)
  kept = step(False, u, state)
  spec = lambda t: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), t)
  assert spec(new) == spec(state) == spec(kept), (
      f"{compressor.name}: the state changes types through an update")


def multi_steps_accumulates(compressor: base.Compressor, every: int = 2, *,
                            atol: float = 1e-6) -> None:
  """Inside ``multi_steps``: zeros until the k-th input, then the update of their mean.

  The running mean ``multi_steps`` keeps and the mean computed here differ in
  their last bits; ``atol`` allows for compressors that amplify that (an SVD's
  singular vectors move by about ``eps · ‖M‖ / gap``).
  """
  tx = _tx(compressor)
  acc = multi_steps(tx, every)
  state = acc.init(params_like())
  us = [_first(worker_updates(50 + i)) for i in range(every)]
  for i, u in enumerate(us):
    out, state = jax.jit(acc.update)(u, state)
    if i < every - 1:
      assert all(not bool(jnp.any(x)) for x in jax.tree.leaves(out)), (
          f"{compressor.name}: multi_steps emitted before its {every}th input")
  mean = jax.tree.map(lambda *xs: sum(xs) / every, *us)
  want, _ = jax.jit(tx.update)(mean, tx.init(params_like()))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol, err_msg=compressor.name)


def chunked_strategies(compressor: base.Compressor, mesh, mesh2d, *,
                       axes=("node", "local"), atol: float = 2e-4) -> None:
  """``two_phase`` on ``mesh`` and ``hierarchical`` on ``mesh2d`` conserve what they owe.

  Both memories enter the balance, and the chunk means are re-encoded, so the
  float32 sums are longer than under ``gather``: ``atol`` is twice as wide.
  """
  error_feedback_conservation(compressor, mesh, "data", strategy="two_phase", atol=atol)
  error_feedback_conservation(compressor, mesh2d, axes, strategy="hierarchical", atol=atol)


def robust_rule_compatible(compressor: base.Compressor, num_workers: int = 8) -> None:
  """A robust rule (the coordinate median) over this compressor's decoded payloads is finite."""
  w = vmap_workers(coordinate_median(axis_name="workers", compressor=compressor, min_size=MIN_SIZE), num_workers)
  out, _ = w.update(worker_updates(60, n=num_workers), w.init(params_like()))
  for key in ("w", "b"):
    assert out[key].shape == (num_workers,) + params_like()[key].shape
    assert bool(jnp.all(jnp.isfinite(out[key]))), f"{compressor.name}: non-finite median"


# Values of other types fed to each kind of option. Each is a valid value
# ``v`` of the option turned into another type (``"8"`` and ``8.0`` for
# ``v = 8``), so only the type is wrong.
_WRONG_TYPES = {
    "bool": lambda v: ["no", "False", 0, 1, 1.0],
    "int": lambda v: [str(v), float(v), True],
    "real": lambda v: [str(v), True, False],
    "str": lambda v: [1, True, b"x"],
}
# A valid value of each kind, for options whose default is None.
_SAMPLE = {"bool": True, "int": 4, "real": 0.5, "str": "x"}


def _option_kind(param: inspect.Parameter, registered) -> tuple:
  """``(kind, none_ok)`` of a factory option: ``kind`` is ``"bool"``, ``"int"``,
  ``"real"``, ``"str"`` or None (another type: a callable, a dtype, a sequence),
  from its annotation, else from its default or its registered default."""
  annotation = param.annotation
  if annotation is inspect.Parameter.empty:
    annotation = ""
  elif not isinstance(annotation, str):
    annotation = getattr(annotation, "__name__", str(annotation))
  words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9.]*", annotation))
  none_ok = param.default is None or bool(words & {"None", "Optional"})
  words -= {"None", "Optional", "Union", "typing.Optional", "typing.Union"}
  if not words:
    sample = param.default if param.default not in (inspect.Parameter.empty, None) else registered
    words = {type(sample).__name__} if sample is not None else set()
  kinds = {"bool": "bool", "int": "int", "float": "real", "str": "str"}
  if words in ({"bool"}, {"int"}, {"str"}, {"float"}, {"float", "int"}):
    return kinds["float" if "float" in words else next(iter(words))], none_ok
  return None, none_ok


def option_types(name: str) -> list[str]:
  """Registered compressor ``name``'s factory refuses every option of the wrong type.

  Each option's kind (bool, integer, real number or string, and whether it
  also takes None) comes from the factory's signature (annotations and
  defaults) and :data:`commopt.compressors.DEFAULTS`; options of other kinds
  (callables, dtypes) are left out. The factory is called as
  :func:`commopt.compressors.make` calls it, with one option replaced by a
  value of another type: a string where a number or a bool belongs, a bool
  where a number belongs, a float where an integer belongs, a number or a
  string where a bool belongs, bytes or a number where a string belongs, and
  None where None is not accepted. Each call must raise ``TypeError`` at
  construction, with a message that names the option (```ratio```) and
  shows the value received.

  Args:
    name: a key of :data:`commopt.compressors.REGISTRY`.

  Returns:
    The options checked, in the signature's order.
  """
  from commopt.compressors import DEFAULTS, REGISTRY, make
  factory = REGISTRY[name]
  make(name)   # the registered defaults are valid
  checked = []
  for option, param in inspect.signature(factory).parameters.items():
    if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
      continue
    registered = DEFAULTS[name].get(option)
    kind, none_ok = _option_kind(param, registered)
    if kind is None:
      continue
    valid = next((v for v in (registered, param.default)
                  if v is not None and v is not inspect.Parameter.empty), _SAMPLE[kind])
    wrong = _WRONG_TYPES[kind](valid) + ([] if none_ok else [None])
    for value in wrong:
      try:
        if value is None:   # make reads None as "the default"
          factory(**{**DEFAULTS[name], option: None})
        else:
          make(name, **{option: value})
      except TypeError as e:
        message = str(e)
        assert f"`{option}`" in message and repr(value) in message, (
            f"{name}: {option}={value!r} raised a TypeError that does not name `{option}` "
            f"and the value received: {message}")
      except Exception as e:   # noqa: BLE001 - reported as the wrong error
        raise AssertionError(f"{name}: {option}={value!r} ({kind} option) raised "
                             f"{type(e).__name__}, not TypeError: {e}") from e
      else:
        raise AssertionError(f"{name}: {option}={value!r} ({kind} option) was accepted")
    checked.append(option)
  return checked


def _sum_decoded_reference(gathered, decode, acc):
  """:func:`commopt.comm.sum_decoded` by the long way: every payload decoded to a dense
  array (``jax.vmap(decode)``), then the rows added to ``acc`` in worker order."""
  decoded = jax.vmap(decode)(gathered)
  n = jax.tree.leaves(gathered)[0].shape[0]
  for w in range(n):
    acc = jax.tree.map(lambda a, t: a + t[w].astype(a.dtype), acc, decoded)
  return acc


def fused_sum_equals_reference(compressor: base.Compressor, workers=(8, 16, 37),
                               dtype=jnp.float32, exact: bool = False) -> None:
  """The gathered reduction's one-pass sum equals decoding every payload.

  For each count in ``workers`` (up to 16 run fully unrolled, 37 through
  the loop), every worker encodes its own input of awkward values (ties, ±0,
  denormals); :func:`commopt.comm.sum_decoded` with the compressor's
  :meth:`~commopt.Compressor.add_decoded` must equal the long way (every
  payload decoded by ``jax.vmap(decode)``, the rows added in worker order)
  under ``jit``: bit for bit with ``exact``, else within one rounding of each decoded term per add. ``exact=False`` is for
  decoders whose last step is an inexact product (``scale · l · (1/top)``):
  once fused, the compiler may contract it with the add into one FMA.
  """
  from commopt.comm import sum_decoded
  shape = (33, 65)
  like = jnp.zeros(shape, dtype)
  for n in workers:
    xs = jnp.stack([hard_floats(shape[0] * shape[1], 100 + w, specials=False, dtype=dtype)
                    .reshape(shape) * (w + 1) for w in range(n)])
    keys = jax.random.split(jax.random.key(n), n)
    state = compressor.init(like)
    payloads, states = jax.vmap(lambda x, k: compressor.encode(x, state, k))(xs, keys)
    state0 = jax.tree.map(lambda a: a[0], states)
    zeros = jnp.zeros(shape, jnp.float32)
    decode = lambda pl: compressor.decode(pl, state0, like)
    fused = np.asarray(jax.jit(lambda g: sum_decoded(
        g, lambda acc, pl: compressor.add_decoded(acc, pl, state0, like), zeros))(payloads))
    want = np.asarray(jax.jit(lambda g: _sum_decoded_reference(g, decode, zeros))(payloads))
    message = f"{compressor.name}, {n} workers"
    if exact:
      np.testing.assert_array_equal(fused, want, err_msg=message)
    else:
      terms = np.abs(np.asarray(jax.vmap(decode)(payloads), np.float32)).sum(0)
      bound = n * np.finfo(np.float32).eps * terms
      assert np.all(np.abs(fused - want) <= bound), message


def run_all(compressor: base.Compressor, mesh, mesh2d=None, *, atol: float = 1e-6,
            conservation_atol: float = 1e-4, exact_sum: bool = False) -> list[str]:
  """Every check that applies to ``compressor``; returns the names of those run.

  Args:
    compressor: the compressor to check.
    mesh: a 1-D mesh with axis ``"data"``.
    mesh2d: a 2-D mesh with axes ``("node", "local")`` for the hierarchical
      check (skipped when None).
    atol: tolerance of :func:`vmap_equals_shard_map`.
    conservation_atol: tolerance of :func:`error_feedback_conservation`.
    exact_sum: the ``exact`` of :func:`fused_sum_equals_reference` (bit for
      bit; true of every built-in decoder but qsgd's and int_quant's).
  """
  ran = []

  def run(check, *args, **kw):
    check(compressor, *args, **kw)
    ran.append(check.__name__)

  run(declared_capabilities)
  run(jit_without_retrace)
  run(dtypes_and_none_leaves, jnp.float32)
  run(dtypes_and_none_leaves, jnp.bfloat16)
  run(vmap_equals_shard_map, mesh, atol=atol)
  run(one_device_equals_local)
  run(error_feedback_conservation, mesh, atol=conservation_atol)
  run(payload_bytes_equal_hlo_audit, mesh)
  run(cond_state_stability)
  run(multi_steps_accumulates)
  if compressor.reduce is None:
    run(fused_sum_equals_reference, exact=exact_sum)
  if base.is_stateless_per_leaf(compressor):
    if mesh2d is not None and "flat_chunks" in compressor.capabilities:
      run(chunked_strategies, mesh, mesh2d, atol=max(2 * conservation_atol, 2e-4))
    run(robust_rule_compatible)
  return ran
