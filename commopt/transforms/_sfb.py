"""Sufficient-factor broadcasting: a dense layer's gradient sent as its factors.

The weight gradient of a dense layer ``y = x W`` over ``B`` rows is
``Σ_b x_bᵀ dy_b``: ``B`` rank-one terms, the *sufficient factors*. When
``B·(n + m) < n·m`` for ``W`` of ``[n, m]``, sending each worker's ``x``
``[B, n]`` and ``dy`` ``[B, m]`` costs less than sending ``W``'s gradient,
and every worker rebuilds the exact mean gradient from them.

Two pieces do it. :func:`sfb_dense` is the dense op: its backward pass,
where the rule chooses it, returns in the kernel's gradient buffer the
factors themselves (``x`` then ``dy``, flat, then zeros, then the row count
as a check) instead of ``xᵀ dy``. :func:`sfb_mean` is the reduction: for
those leaves it all-gathers the factors (``B·(n + m)`` values per worker)
and forms ``(1/N) Σ_w X_wᵀ DY_w``; every other leaf goes through ``other``
(a dense mean by default). The nnx layer :class:`commopt.parallel.SFBLinear` uses
the op.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, finite
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms._compressed_mean import compressed_mean
from commopt.transforms._control import _check_axes
from commopt.transforms import _global_view

# Rows each kernel shape's backward pass saw when last traced: lets
# sfb_mean refuse a `batch_rows` that does not match, at trace time.
_TRACED_ROWS: dict = {}


def sfb_pays(rows: int, n: int, m: int) -> bool:
  """Whether the factors of ``rows`` rows cost less than an ``[n, m]`` gradient:
  ``rows·(n+m) < n·m``.

  Examples:
    >>> from commopt.transforms import sfb_pays
    >>> sfb_pays(32, 1024, 1024), sfb_pays(1024, 64, 10)
    (True, False)

  References:
    Xie et al., Distributed Machine Learning via Sufficient Factor
    Broadcasting, 2015.
  """
  return rows * (n + m) < n * m


@jax.custom_vjp
def sfb_dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """``x @ kernel`` whose kernel gradient carries the sufficient factors where they pay.

  ``x`` is ``[..., n]`` (its leading axes are the rows, ``B``) and ``kernel``
  ``[n, m]``. The forward pass and the gradient with respect to ``x`` are
  the usual ones. The kernel's gradient is ``xᵀ dy`` when
  ``sfb_pays(B, n, m)`` is false; when it is true it is a buffer of the
  kernel's shape holding ``x`` (``B·n`` values), then ``dy`` (``B·m``), then
  zeros, with ``B`` in its last element. Only :func:`sfb_mean` reads that
  buffer: put it first in the optimizer, and use the kernel in no other op
  (a second use would add its gradient into the buffer).

  Args:
    x: the layer's input, ``[..., n]``.
    kernel: the weight, ``[n, m]``.

  Returns:
    ``x @ kernel``, ``[..., m]``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from commopt.transforms import sfb_dense
    >>> x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
    >>> g = jax.grad(lambda w: sfb_dense(x, w).sum())(w)    # 2·(8 + 8) < 64
    >>> g.reshape(-1)[:16].tolist() == [1.0] * 16, float(g.reshape(-1)[-1])
    (True, 2.0)

  References:
    Zhang et al., Poseidon: An Efficient Communication Architecture for
    Distributed Deep Learning on GPU Clusters, USENIX ATC 2017.
  """
  return x @ kernel


def _sfb_fwd(x, kernel):
  return x @ kernel, (x, kernel)


def _pack(x2, dy2, shape, dtype):
  rows = x2.shape[0]
  flat = jnp.concatenate([x2.reshape(-1), dy2.reshape(-1)]).astype(dtype)
  spare = base.leaf_size(shape) - flat.size
  tail = jnp.zeros((spare,), dtype).at[-1].set(rows)
  return jnp.concatenate([flat, tail]).reshape(shape)


def _sfb_bwd(res, dy):
  x, kernel = res
  n, m = kernel.shape
  x2, dy2 = x.reshape(-1, n), dy.reshape(-1, m)
  rows = x2.shape[0]
  _TRACED_ROWS[(n, m)] = rows
  dx = (dy @ kernel.T).astype(x.dtype)
  if sfb_pays(rows, n, m):
    return dx, _pack(x2, dy2, kernel.shape, kernel.dtype)
  return dx, (x2.T @ dy2).astype(kernel.dtype)


sfb_dense.defvjp(_sfb_fwd, _sfb_bwd)


def _is_kernel(x) -> bool:
  return x is not None and jnp.ndim(x) == 2


def sfb_mean(batch_rows: int, mask: Union[Any, Callable[[Any], Any]], *, axis_name,
             other: Optional[optax.GradientTransformation] = None, check_rows: bool = True
             ) -> optax.GradientTransformationExtraArgs:
  """The mean over ``axis_name``, with the kernels of :func:`sfb_dense` sent as their factors.

  A leaf marked by ``mask`` whose ``[n, m]`` shape satisfies
  ``sfb_pays(batch_rows, n, m)`` holds the factors :func:`sfb_dense` packed
  into its gradient: each worker contributes them (``batch_rows·(n + m)``
  values) to one all-gather, and every worker computes the exact mean
  gradient ``(1/N) Σ_w X_wᵀ DY_w`` (to float rounding). Every other leaf,
  marked layers where the factors would cost more included, goes through
  ``other``.

  Put it first in the chain (nothing may change the packed buffers before
  it). Tracing with a ``batch_rows`` other than the rows :func:`sfb_dense`
  saw is refused with an error. With ``check_rows`` each worker also sends
  the row count its buffer holds (one more value), and a buffer whose count
  is not ``batch_rows`` (a kernel used twice adds two buffers, which no
  trace-time check can see) makes that leaf's mean NaN on every worker, and
  with it the parameters: a loud failure instead of a wrong gradient.

  Args:
    axis_name: the data axis (a name; a tuple of axes gathers over all of them).
    batch_rows: the rows each worker's batch puts through the layers: its
      batch size, times the sequence length for ``[B, T, n]`` inputs.
    mask: a pytree of bools like the parameters (True for kernels used by
      :func:`sfb_dense`), or a function of the parameters that returns one
      (:func:`commopt.parallel.sfb_mask` gives it for an nnx model).
    other: the reduction of every other leaf; default the dense mean
      ``compressed_mean(identity(), axis_name=axis_name)``. Any compressed mean works.
    check_rows: send the row count with the factors and check it (above):
      ``batch_rows·(n + m) + 1`` values per chosen leaf; False sends exactly
      ``batch_rows·(n + m)`` and trusts the buffers.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is ``other``'s.

  Examples:
    >>> import jax, jax.numpy as jnp, commopt
    >>> x = jnp.arange(16.0).reshape(2, 8)                   # 2 rows: 2·(8 + 8) < 64
    >>> loss = lambda p: commopt.transforms.sfb_dense(x, p["w"]).sum()
    >>> params = {"w": jnp.ones((8, 8))}
    >>> tx = commopt.transforms.sfb_mean(2, {"w": True}, axis_name=None)
    >>> out, _ = tx.update(jax.grad(loss)(params), tx.init(params))
    >>> bool(jnp.allclose(out["w"], jax.grad(lambda p: (x @ p["w"]).sum())(params)["w"]))
    True

  References:
    Zhang et al., Poseidon: An Efficient Communication Architecture for
    Distributed Deep Learning on GPU Clusters, USENIX ATC 2017.
    Xie et al., Distributed Machine Learning via Sufficient Factor
    Broadcasting, 2015.
  """
  _check_axes(axis_name, "sfb_mean")
  rows = base.check_positive_int("batch_rows", batch_rows, fn="sfb_mean")
  check_rows = base.check_bool("check_rows", check_rows, fn="sfb_mean")
  extra = int(check_rows)
  if other is None:
    from commopt.compressors import identity
    other = compressed_mean(identity(), axis_name=axis_name)

  def chosen(tree):
    marks = mask(tree) if callable(mask) else mask
    try:
      return jax.tree.map(
          lambda m, x: bool(m) and _is_kernel(x) and sfb_pays(rows, *jnp.shape(x)), marks, tree)
    except ValueError as e:
      raise ValueError(
          f"sfb_mean: `mask` must have the parameters' structure (a bool per leaf): {e}") from e

  def rest(tree, picks):
    return jax.tree.map(lambda x, c: None if c else x, tree, picks)

  def init(params):
    return other.init(rest(params, chosen(params)))

  def exact_mean(g):
    n, m = g.shape
    _check_traced(n, m)
    flat = g.reshape(-1)
    sent = flat[:rows * (n + m)]
    if check_rows:
      sent = jnp.concatenate([sent, flat[-1:]])
    factors = coll.all_gather(sent, axis_name)          # [N, B(n+m) (+ 1)]
    xs = factors[:, :rows * n].reshape(-1, rows, n).astype(jnp.float32)
    dys = factors[:, rows * n:rows * (n + m)].reshape(-1, rows, m).astype(jnp.float32)
    mean = jnp.einsum("wbn,wbm->nm", xs, dys) / factors.shape[0]
    if check_rows:
      ok = jnp.all(factors[:, -1] == jnp.asarray(rows, g.dtype))
      mean = jnp.where(ok, mean, jnp.nan)
    return mean.astype(g.dtype)

  def _check_traced(n, m):
    seen = _TRACED_ROWS.get((n, m))
    if seen is not None and seen != rows and sfb_pays(seen, n, m):
      raise ValueError(
          f"sfb_mean: `batch_rows` is {rows}, but sfb_dense last traced a [{n}, {m}] kernel "
          f"with {seen} rows; pass batch_rows={seen} (the rows of each worker's batch).")

  def update(updates, state, params=None, **extra):
    coll.check_input("sfb_mean", updates, axis_name)
    picks = chosen(updates)
    nf = extra.get(finite.EXTRA_ARG)
    if isinstance(nf, finite.NonFinite):
      # `other` reduces only part of the updates: it may carry the skip's flag, but not
      # settle the zero-gradient skip (the chosen leaves' means are not its to judge).
      extra = {**extra, finite.EXTRA_ARG: nf._replace(zero=False)}
    out, state = other.update(rest(updates, picks), state, params, **extra)
    exact = jax.tree.map(lambda g, c: exact_mean(g) if c else None, updates, picks)
    merged = jax.tree.map(lambda o, e, c: e if c else o, out, exact, picks,
                          is_leaf=lambda x: x is None)
    return merged, state

  other_plan = _plan.planner_of(other)

  def planner(params, workers):
    picks = chosen(params)
    sizes = _plan.axis_sizes(axis_name, workers)
    entries = other_plan(rest(params, picks), workers) if other_plan else []
    for (path, x), c in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                            jax.tree.leaves(picks)):
      if c:
        n, m = x.shape
        nbytes = (rows * (n + m) + extra) * jnp.dtype(x.dtype).itemsize
        entries += _plan.gather_plan(jax.tree_util.keystr(path), axis_name, sizes, nbytes,
                                     packed=True)
    return entries

  return _plan.with_planner(
      _global_view.accepting(optax.GradientTransformationExtraArgs(init, update), axis_name,
                             "sfb_mean"), planner)

