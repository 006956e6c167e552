"""One-step-delayed updates: the exchange of step t's gradient runs during step t+1's compute.

In a data-parallel step every exchange waits for the whole backward pass, so
a step costs compute plus communication. :func:`pipelined` keeps each
worker's gradient for ``delay`` steps and runs the wrapped transform (which
holds the exchange) on the gradient it kept. What crosses the wire in step
``t`` is then known before step ``t`` begins, so the collective does not
depend on step ``t``'s forward and backward pass and may run beside them: a
step costs ``max(compute, communication)`` where the runtime overlaps the
two. The price is a stale gradient: ``θₜ₊₁ = θₜ + inner(g_{t−delay})``,
as in Pipe-SGD and the overlapped outer steps of streaming DiLoCo.

The timeline (``delay=1``)::

    step t:   forward/backward at θₜ -> gₜ          (this worker's, kept)
              exchange of g_{t-1}  -> uₜ            (independent of gₜ)
              θₜ₊₁ = θₜ + uₜ
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, finite as fin, vma
from commopt.comm import _collectives as coll
from commopt.transforms._control import _check_inner


class PipelinedState(NamedTuple):
  """State of :func:`pipelined`.

  Attributes:
    count: updates so far (int32, saturating); the same on every worker. The
      first ``delay`` updates are zeros.
    pending: a tuple of ``delay`` pytrees like the updates, oldest first:
      this worker's inputs not yet handed to ``inner``, in the parameters'
      dtypes. Per worker under :func:`~commopt.data_parallel` (stacked over
      the data axes, like an error-feedback residual); saved with the rest
      of the state by a checkpoint.
    dropped: kept inputs whose ``inner`` output was not finite (an overflow
      in the exchange or the optimizer) and which were therefore dropped
      (int32); the same on every worker.
    inner_state: the wrapped transform's state.
  """
  count: jax.Array
  pending: tuple
  dropped: jax.Array
  inner_state: Any


def _zeros_like(x):
  return jnp.zeros(jnp.shape(x), jnp.result_type(x))


def pipelined(inner: optax.GradientTransformation, *, delay: int = 1
              ) -> optax.GradientTransformationExtraArgs:
  """Runs ``inner`` on the updates of ``delay`` steps ago, so its exchange overlaps compute.

  Each call keeps this worker's incoming updates (its gradient) and hands
  ``inner`` the ones kept ``delay`` calls earlier. Put the exchange inside
  and, under :func:`~commopt.data_parallel`, the agreed non-finite skip too:
  ``pipelined(apply_if_finite(optax.chain(compressed_mean(c,
  axis_name="data"), optax.sgd(lr)), axis_name="data"))`` with
  ``data_parallel(..., skip_nonfinite=False)``. No collective then reads
  this step's gradient, and a runtime may run the exchange beside the
  forward and backward pass. (``data_parallel``'s own skip agrees on this
  step's gradient before the optimizer runs, so the exchange waits for it.)
  The update applied at step ``t`` is ``inner(g_{t−delay})``; ``params``
  and extra arguments (``value``) are this step's, so weight decay is not
  delayed.

  - **First steps.** The first ``delay`` calls return zeros (negative zeros:
    ``params + updates`` is the parameters bit for bit) and keep ``inner``'s
    state as it was; ``inner`` still runs, on zeros, so every call runs the
    same collectives (no ``cond`` around them). Later, update ``t + delay``
    equals ``inner``'s update ``t`` on the same inputs, bit for bit, random
    keys and residuals included. Running the first step on its own gradient
    instead would send that gradient twice or leave a later step empty, and
    would not overlap.
  - **Error feedback.** ``inner``'s compressor sees the delayed stream
    ``g_0, g_1, ...`` one step late and keeps its residual of that stream,
    so nothing is lost: with ``optax.sgd(lr)`` the updates applied so far
    are ``−lr`` times the sum of the workers' mean gradients less what is
    still owed, the mean residual and the mean pending gradient (to
    rounding).
  - **Memory.** ``delay`` copies of the gradient per worker, in the
    parameters' dtypes. The dense gradient is kept, not the encoded payload:
    encoding it now would read the residual before the exchange of the
    previous gradient updated it (a second, different error-feedback
    recursion), and ``inner`` may be any transform.
  - **Non-finite steps.** With the agreed skip inside, a NaN gradient is
    kept, and the next step's agreement (on the kept gradient) drops it:
    zeros are applied and ``inner``'s residuals and optimizer state are
    kept. Under ``data_parallel``'s own skip, the step whose gradient is
    not finite is skipped whole, the kept gradient included, so the NaN is
    never kept. Either way, an output of ``inner`` that is not finite
    although its input was (an overflow in the exchange or the optimizer)
    is dropped here: zeros are returned, ``inner``'s state is kept, the new
    gradient is kept as usual and ``dropped`` counts it, so an exchange
    that overflowed is not sent again. The check reads the reduced output,
    the same on every worker, with no collective.
  - **Convergence.** A stale gradient narrows the stable step sizes. On a
    quadratic of curvature ``L``, SGD with one step of delay is stable for
    ``lr·L < 1`` (``< 2`` without delay; with ``delay=d``,
    ``lr·L < 2 sin(π/(4d+2))``), heavy-ball momentum ``β`` for
    ``lr·L < 1 − β`` (``< 2(1+β)`` without): the effective step
    ``lr/(1−β)`` must stay below ``1/L``. Below that bound the delayed run
    follows the undelayed one closely (see the guide's "Overlapping
    communication" page for measurements).

  Args:
    inner: the transform to delay, holding the exchange, e.g.
      ``optax.chain(compressed_mean(c, axis_name="data"), optax.sgd(lr))``.
    delay: steps between computing a gradient and handing it to ``inner``,
      an integer >= 1. One step suffices to overlap one exchange with one
      step's compute; more only stales the gradient further.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`PipelinedState`.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.transforms.pipelined(optax.sgd(1.0))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 2.0, 3.0):
    ...   updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
    ...   print(updates["w"].tolist())
    [-0.0, -0.0]
    [-1.0, -1.0]
    [-2.0, -2.0]

  References:
    Li et al., Pipe-SGD: A Decentralized Pipelined SGD Framework for
    Distributed Deep Net Training, NeurIPS 2018.
    Douillard et al., Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch, 2025.
    Kale et al., Eager Updates For Overlapped Communication and Computation
    in DiLoCo, 2025.
  """
  fn = "pipelined"
  inner = _check_inner(inner, fn)
  delay = base.check_int("delay", delay, fn=fn, minimum=1)

  def init_fn(params):
    return PipelinedState(
        count=jnp.zeros([], jnp.int32),
        pending=tuple(jax.tree.map(_zeros_like, params) for _ in range(delay)),
        dropped=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    _check_updates(updates, state.pending[0])
    # What goes out now was kept `delay` calls ago: it does not depend on `updates`. It is
    # this worker's, typed varying like `updates` (a state leaf not yet known to be per
    # worker is typed replicated while data_parallel traces its layout).
    sent = jax.tree.map(lambda p, u: vma.vary_like(p.astype(jnp.result_type(u)), u),
                        state.pending[0], updates)
    # `sent` is not this call's input: a non-finite skip's flag is not handed on.
    out, new_inner = inner.update(sent, state.inner_state, params, **fin.without(extra_args))
    with vma.shard_aware():
      finite = coll.reduced_finite(out, None)
    warm = state.count >= delay              # the same on every worker
    keep = warm & finite
    out = jax.tree.map(lambda u: jnp.where(keep, u, fin.skip_zeros(u)), out)
    new_inner = fin.hold_unless(keep, new_inner, state.inner_state)
    kept = jax.tree.map(lambda u, p: u.astype(jnp.result_type(p)), updates, state.pending[0])
    return out, PipelinedState(
        count=optax.safe_int32_increment(state.count),
        pending=state.pending[1:] + (kept,),
        dropped=jnp.where(warm & ~finite, optax.safe_int32_increment(state.dropped),
                          state.dropped),
        inner_state=new_inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_updates(updates, pending) -> None:
  """A ValueError naming the mismatch if ``updates`` is not shaped like the parameters
  given to ``init`` (what is kept must be what comes later)."""
  got, want = jax.tree.structure(updates), jax.tree.structure(pending)
  if got != want:
    raise ValueError(f"pipelined: the updates' tree {got} differs from the parameters' "
                     f"given to init, {want}; pass updates shaped like the parameters.")
  for path, (u, p) in zip((k for k, _ in jax.tree_util.tree_flatten_with_path(updates)[0]),
                          zip(jax.tree.leaves(updates), jax.tree.leaves(pending))):
    if jnp.shape(u) != jnp.shape(p):
      raise ValueError(
          f"pipelined: update {jax.tree_util.keystr(path)} has shape {jnp.shape(u)}, but "
          f"init was given a parameter of shape {jnp.shape(p)} there; pass updates shaped "
          "like the parameters.")
