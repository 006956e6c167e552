"""Faults: the agreed non-finite skip (``data_parallel(..., skip_nonfinite=True)``).

The optimizer runs inside :func:`commopt.transforms.apply_if_finite`, whose
skip every worker agrees on (:func:`optimizer`). Model state rides along: a
worker whose new model state is not finite poisons its gradients so that the
skip covers it (:func:`poison_if_nonfinite`), and a skipped step keeps the old
model state (:func:`keep_on_skip`). The step bodies call both; the functions
take the :class:`~commopt.DataParallel` as ``dp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from commopt._src.finite import all_finite
from commopt.comm import _plan
from commopt.transforms._control import apply_if_finite


def optimizer(tx, axis_name, skip_nonfinite, local=False) -> optax.GradientTransformation:
  """The transformation the step runs: ``tx``, wrapped in an agreed non-finite skip
  (``skip_nonfinite``: True, False or ``"zero"``, see :func:`apply_if_finite`).

  ``local``: the workers keep their own parameters and nothing else makes them meet
  on every step (``local_params`` without model state). Then, for a ``tx`` that
  registers when it exchanges (the synchronisation modes), the workers agree only on
  those steps, and in between each skips its own (``apply_if_finite``'s
  ``agree_when``): no collective runs between exchanges."""
  if skip_nonfinite is False:
    return optax.with_extra_args_support(tx)
  zero = skip_nonfinite == "zero"
  exchanges = _plan.exchanges_of(tx) if local and not zero else None
  return apply_if_finite(tx, axis_name=axis_name, agree_when=exchanges,
                         on_skip="zero" if zero else "keep")


def poison_if_nonfinite(dp, grads, new_model_state):
  """A worker whose new model state is not finite sends NaN gradients, so the agreed
  skip (``skip_nonfinite``) also covers state that the gradients do not reach."""
  if not (dp.skip_nonfinite and dp.has_state):
    return grads
  # Floating-point leaves only: model state may hold PRNG keys, which have no isfinite.
  floats = [x for x in jax.tree.leaves(new_model_state) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not floats:
    return grads
  ok = all_finite(floats)
  return jax.tree.map(lambda g: jnp.where(ok, g, jnp.nan).astype(g.dtype), grads)


def keep_on_skip(dp, new_model_state, model_state, new_opt_state):
  """The old model state where the agreed non-finite skip dropped the step."""
  if not dp.skip_nonfinite:
    return new_model_state
  ok = new_opt_state.last_finite
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_model_state, model_state)
