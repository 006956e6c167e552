"""The non-finite skip's protocol between :func:`~commopt.transforms.apply_if_finite` and
the exchange it wraps, and the flags both read.

The skip and the exchange cooperate through arguments and state, never ambiently:

1. ``apply_if_finite`` calls its inner transform with the extra argument
   ``nonfinite=NonFinite(...)`` (optax's extra-args protocol: ``optax.chain``
   hands it to every transform of a chain; a transform that does not know it
   ignores it).
2. An exchange over exactly ``NonFinite.axes`` (:func:`~commopt.compressed_mean`)
   may carry ``flag`` as one more element of a dense all-reduce it runs anyway,
   and answers by returning its new state wrapped in an :class:`Answer`: whether
   every worker's input was finite. With ``zero``, an exchange whose input has the
   wrapper's input's structure (``NonFinite.structure``: it reduces the wrapper's
   very updates) also judges its own mean, returns a zero mean and keeps its own
   state where the verdict is false, and says so by a :class:`Settled` instead.
3. ``apply_if_finite`` reads those answers out of the inner state and unwraps them,
   so the state it returns has the structure ``init`` gave (and a checkpoint
   holds no answer). Where nothing answered, it agrees on the flag with an
   all-reduce of its own.

A transform that runs its inner transform only on some steps (inside a
``lax.cond``: :func:`~commopt.transforms.multi_steps`, the synchronisation modes'
inner steps), or on something other than its own input
(:func:`~commopt.transforms.pipelined`), does not pass ``nonfinite`` on
(:func:`without`): an answer from inside a branch would not exist on the steps
that skip it, and a verdict on another input is not the one asked for.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from commopt._src import base

EXTRA_ARG = "nonfinite"
"""The name of the extra argument that carries a :class:`NonFinite`."""


class NonFinite(NamedTuple):
  """What :func:`~commopt.transforms.apply_if_finite` hands its inner transform, as the
  extra argument ``nonfinite``.

  Attributes:
    axes: the data axes over which the workers agree (a tuple of names).
    flag: this worker's :func:`nonfinite_flag` of the wrapper's input, for an exchange
      over exactly ``axes`` to carry in a dense all-reduce; None where ``agreed`` is
      known already.
    agreed: the workers' verdict on the input (a bool, the same on every worker) where
      it was agreed before the inner transform ran, else None. A synchronisation mode
      that exchanges only on some steps reads it to veto an exchange every worker skips.
    zero: the zero-gradient skip (``on_skip="zero"``): an exchange that answers also
      judges its own mean, and where its verdict is false returns a zero mean and keeps
      its own state.
    structure: the tree structure of the wrapper's input, by which an exchange tells
      that it reduces those very updates (only such an exchange settles ``zero``).
  """
  axes: tuple
  flag: Optional[jax.Array] = None
  agreed: Optional[jax.Array] = None
  zero: bool = False
  structure: Any = None

  def for_axes(self, axis_name) -> bool:
    """Whether an exchange over ``axis_name`` reduces over exactly these axes."""
    return axis_name is not None and base.axis_names(axis_name) == self.axes


class Answer(NamedTuple):
  """An exchange's state, returned wrapped to answer a :class:`NonFinite`.

  Attributes:
    state: the exchange's new state, as it returns it otherwise.
    finite: whether every worker's input was finite (a bool, the same on every worker).
  """
  state: Any
  finite: jax.Array


class Settled(NamedTuple):
  """As :class:`Answer`, from an exchange that settled the zero-gradient skip itself: it
  judged its own mean too (``finite``), and where that is false returned a zero mean and
  its state as it was (``state``)."""
  state: Any
  finite: jax.Array


def is_answer(x) -> bool:
  return isinstance(x, (Answer, Settled))


def offered(extra_args: dict, axis_name) -> Optional[NonFinite]:
  """The :class:`NonFinite` in ``extra_args`` meant for an exchange over ``axis_name``, or
  None."""
  nf = extra_args.get(EXTRA_ARG)
  return nf if isinstance(nf, NonFinite) and nf.for_axes(axis_name) else None


def without(extra_args: dict) -> dict:
  """``extra_args`` without ``nonfinite``: for an inner transform run only on some steps."""
  return {k: v for k, v in extra_args.items() if k != EXTRA_ARG}


def nonfinite_flag(tree) -> jax.Array:
  """A float32 scalar that is 0 when every value of ``tree`` is finite and NaN otherwise.

  ``v - v`` of each floating-point leaf's sum ``v``: a NaN or an infinity in
  the leaf makes its sum NaN or infinite, and ``v - v`` of a scalar is NaN
  exactly when ``v`` is not finite. One reduction reading the leaf as it is
  (a sum is the cheapest: XLA:CPU does not fuse an elementwise pass such as
  ``isfinite(x)`` into a reduction of a leaf that other ops also read, and
  writes it out whole first). A leaf whose float32 sum overflows (values
  around ``1e32`` and beyond, over a million of them) counts as non-finite
  too. Integer leaves are always finite.
  """
  flags = []
  for x in jax.tree.leaves(tree):
    if base.is_float_dtype(x.dtype) and x.size:
      v = jnp.sum(x, dtype=jnp.float32)
      flags.append(v - v)
  return functools.reduce(jnp.add, flags, jnp.zeros((), jnp.float32))


def all_finite(tree) -> jax.Array:
  """Whether every value of every leaf of ``tree`` is finite (a scalar bool)."""
  return jnp.isfinite(nonfinite_flag(tree))


def skip_zeros(x):
  """The update that leaves a parameter as it is: negative zeros for floats (``p + -0.0``
  is ``p`` bit for bit, ``+0.0`` and ``-0.0`` included), zeros otherwise."""
  if base.is_float_dtype(x.dtype):
    return jnp.full(x.shape, -0.0, x.dtype)
  return jnp.zeros(x.shape, x.dtype)


def select(pred, new, old):
  """``new`` where ``pred``, else ``old``, in ``old``'s dtype."""
  out = jnp.where(pred, new, old)
  return out if out.dtype == old.dtype else out.astype(old.dtype)


def hold_unless(ok: jax.Array, new, old):
  """``new`` where ``ok``, else ``old``, leaf by leaf (XLA drops the select of a leaf that
  did not change)."""
  return jax.tree.map(lambda n, o: select(ok, n, o), new, old)


def zero_unless(ok: jax.Array, x):
  """``x`` where ``ok``, else zeros of its shape and dtype (an array leaf; a placeholder
  such as ``None`` as it is)."""
  if not isinstance(x, jax.Array):
    return x
  return jnp.where(ok, x, jnp.zeros((), x.dtype))
