"""Control wrappers that are safe across workers: skipping non-finite steps, accumulating.

``optax.apply_if_finite`` and ``optax.MultiSteps`` branch with ``lax.cond``.
Inside ``jax.shard_map`` an output that one branch returns per worker
(varying: zeros shaped like the local gradients, updated residuals,
accumulated gradients) the other returns replicated (the reduced updates, the
incoming state), which ``lax.cond`` rejects ("cond branches must have equal
output types"). And ``apply_if_finite``'s predicate is computed from each
worker's own gradients, so with ``check_vma=False`` a worker that sees a NaN
skips the branch holding a collective that the other workers wait in, and the
step deadlocks. :func:`apply_if_finite` here agrees before it selects and
never branches; :func:`multi_steps` branches on a counter that is the same on
every worker, with the branches' outputs joined over their varying axes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, finite, vma
from commopt.comm import _collectives as coll
from commopt.comm import _plan
from commopt.transforms import _global_view


class ApplyIfFiniteState(NamedTuple):
  """State of :func:`apply_if_finite` (the fields of ``optax.ApplyIfFiniteState``).

  Attributes:
    notfinite_count: consecutive updates skipped (int32): where some worker
      saw a NaN or an Inf, in its input or in the reduced output; reset to 0
      by a finite update. With ``agree_when``, this worker's own: its skips
      alone between exchanges and the agreed ones.
    last_finite: whether the last update went through (bool): the same on
      every worker, or this worker's own with ``agree_when``.
    total_notfinite: updates skipped since ``init`` (int32), counted as
      ``notfinite_count``; never reset.
    inner_state: the state of the wrapped transform.

  With ``agree_when`` the counters are per worker: under ``shard_map`` they
  leave the map stacked over the workers, and a ``lax.scan`` carry of this
  state must type them as varying over ``axis_name`` (``init`` returns
  them replicated).
  """
  notfinite_count: jax.Array
  last_finite: jax.Array
  total_notfinite: jax.Array
  inner_state: Any


class MultiStepsState(NamedTuple):
  """State of :func:`multi_steps` (the fields of ``optax.MultiStepsState``).

  Attributes:
    mini_step: calls since the last inner step (int32), in ``[0, k)``; the
      same on every worker.
    gradient_step: inner steps taken (int32); the argument of a schedule.
    inner_opt_state: the state of the wrapped transform.
    acc_grads: this worker's running mean of the updates since the last inner
      step, in float32 or wider; per worker under ``shard_map``.
  """
  mini_step: jax.Array
  gradient_step: jax.Array
  inner_opt_state: Any
  acc_grads: Any


def _check_inner(inner, fn: str) -> optax.GradientTransformationExtraArgs:
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise base.OptionTypeError(
        f"{fn}: `inner` must be an optax GradientTransformation (with init and update), "
        f"got {inner!r}.")
  return optax.with_extra_args_support(inner)


def _check_axes(axis_name, fn: str) -> None:
  if axis_name is None:
    return
  names = base.axis_names(axis_name)
  if (not names or not all(isinstance(a, str) for a in names)
      or len(set(names)) != len(names)):
    error = ValueError if isinstance(axis_name, tuple) and all(
        isinstance(a, str) for a in names) else base.OptionTypeError
    raise error(
        f"{fn}: `axis_name` must be None, a mesh axis name (str) or a tuple of distinct "
        f"names, got {axis_name!r}.")


def _run_or_hold(pred, run, operand, inner_state):
  """``run(operand, inner_state)`` where ``pred`` (the same on every worker), else updates of
  negative zeros shaped like its output and ``inner_state`` as it was: one ``lax.cond``."""
  def hold(x, s):
    shapes, _ = jax.eval_shape(run, x, s)
    return jax.tree.map(finite.skip_zeros, shapes), s
  return coll.cond(pred, run, hold, operand, inner_state)


def _check_agree_when(agree_when, axis_name, max_consecutive_errors) -> None:
  """Refuses an ``agree_when`` that is not callable, or with options it does not serve."""
  if agree_when is None:
    return
  if not callable(agree_when):
    raise base.OptionTypeError(f"apply_if_finite: `agree_when` must be None or a function of "
                               f"the inner state, got {agree_when!r}.")
  if axis_name is None or max_consecutive_errors is not None:
    raise ValueError(
        "apply_if_finite: `agree_when` needs an `axis_name` and max_consecutive_errors=None, "
        f"got axis_name={axis_name!r}, max_consecutive_errors={max_consecutive_errors!r}.")


def _apply_if_finite_options(inner, axis_name, strict, max_consecutive_errors, agree_when,
                             on_skip) -> tuple:
  """``(inner, max_consecutive_errors, zero)`` checked; ``zero``: whether ``on_skip`` asks
  for the zero-gradient skip, refused with options it does not serve."""
  fn = "apply_if_finite"
  inner = _check_inner(inner, fn)
  _check_axes(axis_name, fn)
  if not (strict is None or strict is True):
    raise ValueError(
        f"apply_if_finite: strict={strict!r} was removed: the inner transform always runs and "
        "its state is kept on a skip. For the cheapest agreed skip pass on_skip='zero' (the "
        "optimizer takes a zero gradient); on one worker optax.apply_if_finite runs the inner "
        "transform inside a lax.cond.")
  if max_consecutive_errors is not None:
    max_consecutive_errors = base.check_int("max_consecutive_errors", max_consecutive_errors,
                                            fn=fn, minimum=0)
  _check_agree_when(agree_when, axis_name, max_consecutive_errors)
  base.check_choice("on_skip", on_skip, ("keep", "zero"), fn)
  if on_skip == "zero" and (max_consecutive_errors is not None or agree_when is not None):
    raise ValueError(
        "apply_if_finite: `on_skip` 'zero' needs max_consecutive_errors=None and "
        f"agree_when=None, got max_consecutive_errors={max_consecutive_errors!r}, "
        f"agree_when={agree_when!r}.")
  return inner, max_consecutive_errors, on_skip == "zero"


def _varies(tree, axis_name) -> bool:
  """Whether some leaf of ``tree`` differs between workers (:func:`coll.per_worker`)."""
  return any(coll.per_worker(x, axis_name) for x in jax.tree.leaves(tree))


def _input_verdicts(updates, inner_state, axis_name, agree_when) -> tuple:
  """``(worker, agreed)``: whether this worker's input ``updates`` are finite (on every shard
  of its model axes), and whether every worker's are. Without ``agree_when`` (or without
  varying types to tell per-worker state apart) both are the agreed verdict, one all-reduce;
  with it the workers agree only where ``agree_when(inner_state)``, and ``agreed`` is true
  on the other steps, where no collective over ``axis_name`` runs."""
  if agree_when is None or not _varies(updates, axis_name):
    ok = coll.agreed_finite(updates, axis_name)
    return ok, ok
  bad = jnp.logical_not(finite.all_finite(updates)).astype(jnp.int32)
  model = coll.model_axes_of(updates, axis_name)
  if model:
    bad = jnp.minimum(coll.psum(bad, model), 1)
  now = agree_when(inner_state)
  if _varies(now, axis_name):
    raise ValueError(
        f"apply_if_finite: `agree_when` must return the same value on every worker (computed "
        f"from state the workers share, such as a step count); it returned a value that varies "
        f"over {axis_name!r}, so the workers could disagree on when to agree and deadlock.")
  agreed = coll.cond(now,
                     lambda b: coll.psum(b, coll.axes_of(axis_name)) == 0,
                     lambda b: jnp.array(True), bad)
  return (bad == 0) & agreed, agreed


def _hold_state(new, old, worker, shared, axis_name, shared_held=False):
  """The new state where its step applies, else the old: a leaf that varies over
  ``axis_name`` by the ``worker`` verdict, a leaf the same on every worker by the
  ``shared`` one (so it stays the same on every worker), unless ``shared_held``: the
  transform held those itself (a synchronisation mode given the agreed verdict)."""
  def hold(n, o):
    if coll.per_worker(n, axis_name):
      return finite.select(worker, n, o)
    return n if shared_held else finite.select(shared, n, o)
  return jax.tree.map(hold, new, old)


def _first_with_state(state):
  """The state of the first transform, in the order the transforms ran, that holds any
  array: ``state`` itself, or for a chain's tuple (or a named chain's dict, in its
  insertion order), that of its first element holding any, looked into the same way."""
  if isinstance(state, (tuple, list)) and not hasattr(state, "_fields"):
    parts = list(state)
  elif isinstance(state, dict):
    parts = list(state.values())
  else:
    return state
  for part in parts:
    if jax.tree.leaves(part):
      return _first_with_state(part)
  return None


def _answers(inner_state) -> tuple:
  """``(verdicts, inner_state, settled)``: the verdicts the exchanges in ``inner_state``
  answered the skip with (their states wrapped in ``finite.Answer`` or
  ``finite.Settled``), the state with them unwrapped (as ``init`` made it), and whether
  the first transform with state (in the order they ran) is an exchange that settled
  the zero-gradient skip: then no transform with state ran before it on the non-finite
  input, and it held its own state (:mod:`commopt._src.finite`)."""
  verdicts = []

  def unwrap(x):
    if finite.is_answer(x):
      verdicts.append(x.finite)
      return x.state
    return x
  settled = isinstance(_first_with_state(inner_state), finite.Settled)
  return verdicts, jax.tree.map(unwrap, inner_state, is_leaf=finite.is_answer), settled


def _offer(inner, nf, updates, inner_state, params, extra_args) -> tuple:
  """``inner.update`` with the extra argument ``nonfinite=nf`` (where ``nf`` is not None),
  or without it for a transform of the user's that takes no such keyword."""
  if nf is None:
    return inner.update(updates, inner_state, params, **extra_args)
  try:
    return inner.update(updates, inner_state, params, **extra_args,
                        **{finite.EXTRA_ARG: nf})
  except TypeError as e:
    if f"unexpected keyword argument '{finite.EXTRA_ARG}'" not in str(e):
      raise
    return inner.update(updates, inner_state, params, **extra_args)


def _carried(nf: finite.NonFinite, verdicts: list, axis_name, after) -> jax.Array:
  """The workers' agreed verdict on the flag ``nf`` handed to the inner transform: from the
  exchanges that answered (``verdicts``), else by an all-reduce of its own, after every
  collective of ``after`` (the inner transform's outputs: gloo needs them in one order)."""
  if verdicts:
    return functools.reduce(jnp.logical_and, verdicts)
  with vma.shard_aware():
    bad = jnp.isnan(nf.flag).astype(jnp.int32)
    return coll.psum(coll.after(bad, after), axis_name) == 0


def apply_if_finite(inner: optax.GradientTransformation, *,
                    axis_name: Optional[str | tuple[str, ...]] = None,
                    max_consecutive_errors: Optional[int] = None,
                    agree_when: Optional[Callable[[Any], Any]] = None,
                    on_skip: str = "keep",
                    strict: Optional[bool] = None) -> optax.GradientTransformationExtraArgs:
  """Skips, on every worker together, an update in which any worker saw a NaN or Inf.

  Each worker checks its own input updates and the workers agree whether any was
  not finite (the flag rides in a dense all-reduce of a
  :func:`~commopt.compressed_mean` over ``axis_name``, else one int32 all-reduce);
  the reduced output is checked too, with no further collective. ``inner`` always
  runs, so every worker runs the same collectives; on a skip its state (residuals
  included) is kept and the returned updates are zeros. Unlike
  ``optax.apply_if_finite``, it works across workers under ``jax.shard_map``.

  See the "Non-finite steps" part of the guide's "Data parallel training" page.

  Args:
    inner: the transform to guard, e.g. ``optax.chain(compressed_mean(c,
      axis_name="data"), optax.sgd(lr))``.
    axis_name: the named axis (or tuple of axes) whose workers must agree, or
      ``None`` for one local worker.
    max_consecutive_errors: ``None`` to skip every non-finite update; an
      integer ``m >= 0`` to apply the update anyway once more than ``m``
      consecutive updates were not finite, as optax does.
    agree_when: for an ``inner`` that exchanges only on some steps (synchronisation
      modes): a function of its state, the same on every worker, true on the steps it
      exchanges or merges; the workers agree only then (not with ``max_consecutive_errors``).
    on_skip: ``"keep"`` (default: every state kept) or ``"zero"`` (a leading
      ``compressed_mean`` returns a zero mean the optimizer steps on); not with
      ``max_consecutive_errors`` or ``agree_when``.
    strict: removed; ``True`` is accepted, ``False`` raises an error naming the
      replacement (``on_skip="zero"``, or ``optax.apply_if_finite`` on one worker).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`ApplyIfFiniteState`.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.transforms.apply_if_finite(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, state, params)
    >>> optax.apply_updates(params, updates)["w"].tolist(), int(state.total_notfinite)
    ([1.0, 1.0, 1.0], 1)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
    >>> updates["w"].tolist(), bool(state.last_finite)
    ([-0.10000000149011612, -0.10000000149011612, -0.10000000149011612], True)

  References:
    ``optax.apply_if_finite``, whose state and counting this follows.
  """
  inner, max_consecutive_errors, zero = _apply_if_finite_options(
      inner, axis_name, strict, max_consecutive_errors, agree_when, on_skip)
  names = coll.axes_of(axis_name)
  # A synchronisation mode that registered when it exchanges holds the state the workers
  # share itself, given the agreed verdict (commopt.transforms._sync._common._advance).
  shared_held = agree_when is not None and _plan.exchanges_of(inner) is not None

  def init_fn(params):
    return ApplyIfFiniteState(
        notfinite_count=jnp.zeros([], jnp.int32),
        last_finite=jnp.array(True),
        total_notfinite=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    # An outer skip's flag is not this one's to pass on: this skip answers for its inner.
    extra_args = finite.without(extra_args)
    structure = jax.tree.structure(updates)
    with vma.shard_aware():
      carry = bool(names) and agree_when is None and not coll.model_axes_of(updates, axis_name)
      if carry:
        # Agreed in the exchange, where one carries the flag (below, where none does).
        nf = finite.NonFinite(names, flag=finite.nonfinite_flag(updates), zero=zero,
                              structure=structure)
      else:
        worker, agreed = _input_verdicts(updates, state.inner_state, axis_name, agree_when)
        # Every collective of `inner` runs after the verdict's, not beside it.
        updates = coll.after(updates, agreed)
        nf = (finite.NonFinite(names, agreed=agreed, zero=zero, structure=structure)
              if names else None)
    new_updates, new_inner = _offer(inner, nf, updates, state.inner_state, params, extra_args)
    verdicts, new_inner, settled = _answers(new_inner)
    settled = settled and zero
    if carry:
      worker = agreed = _carried(nf, verdicts, axis_name, (new_updates, new_inner))
    elif verdicts:
      answered = functools.reduce(jnp.logical_and, verdicts)
      agreed, worker = agreed & answered, worker & answered
    if not settled:
      # The exchange judged its inputs and its mean itself where it settled.
      with vma.shard_aware():
        out_ok = coll.reduced_finite(new_updates, axis_name)
      agreed, worker = agreed & out_ok, worker & out_ok
    notfinite_count = jnp.where(worker, jnp.zeros([], jnp.int32),
                                optax.safe_int32_increment(state.notfinite_count))
    apply = worker
    if max_consecutive_errors is not None:
      apply = worker | (notfinite_count > max_consecutive_errors)
    new_updates = jax.tree.map(lambda u: jnp.where(apply, u, finite.skip_zeros(u)),
                               new_updates)
    if not settled:
      new_inner = _hold_state(new_inner, state.inner_state, apply,
                              apply if agree_when is None else agreed, axis_name,
                              shared_held=shared_held and not _shared(new_updates, axis_name))
    return new_updates, ApplyIfFiniteState(
        notfinite_count=notfinite_count, last_finite=worker,
        total_notfinite=jnp.where(worker, state.total_notfinite,
                                  optax.safe_int32_increment(state.total_notfinite)),
        inner_state=new_inner)

  return _global_view.accepting(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                                axis_name, "apply_if_finite")


def _shared(tree, axis_name) -> list:
  """The leaves of ``tree`` that vary over no axis of ``axis_name`` (the same on every
  worker, sharded over model axes or not)."""
  return [x for x in jax.tree.leaves(tree) if not coll.per_worker(x, axis_name)]


def _accumulator_dtype(dtype):
  return jnp.promote_types(dtype, jnp.float32) if base.is_float_dtype(dtype) else dtype


def multi_steps(inner: optax.GradientTransformation,
                every_k_schedule: Union[int, Callable[[jax.Array], Any]]
                ) -> optax.GradientTransformationExtraArgs:
  """Accumulates ``k`` calls' updates on each worker and runs ``inner`` once per ``k``.

  Each worker keeps the running mean of its own updates (no communication);
  on every ``k``-th call ``inner`` (which holds the communication, e.g.
  :func:`~commopt.compressed_mean`) runs on that mean and its output is
  returned, and the other calls return zeros. Collectives therefore run only
  on every ``k``-th call: ``inner`` sits in a ``cond`` whose predicate is the
  call counter, which is the same on every worker, so all workers take the
  same branch and none waits in a collective another skipped. With a mean
  loss on equal micro-batches this is one step of ``inner`` on the ``k``
  times larger batch.

  ``optax.MultiSteps`` does not type-check under ``jax.shard_map``: its
  ``lax.cond`` returns the accumulated gradients and the inner state (its
  error-feedback residuals) per worker from one branch and as they came in,
  replicated, from the other, and the reduced, replicated updates from one
  branch against per-worker zeros from the other; ``lax.cond`` requires every
  output to vary over the same axes in both ("cond branches must have equal
  output types"). Here the branches' outputs are joined over their varying
  axes. optax's also calls ``inner.update`` on every call and keeps the
  result only on every k-th, which would put ``inner``'s collectives on every
  call.

  Args:
    inner: the transform run every ``k`` calls, e.g. ``optax.chain(
      compressed_mean(c, axis_name="data"), optax.sgd(lr))``.
    every_k_schedule: ``k``, an integer >= 1, or a function of the number of
      inner steps taken (an int32 scalar) that returns it.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`MultiStepsState`.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.transforms.multi_steps(optax.sgd(1.0), every_k_schedule=2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> for g in (1.0, 3.0):
    ...   updates, state = tx.update({"w": jnp.full(2, g)}, state)
    ...   params = optax.apply_updates(params, updates)
    ...   print(params["w"].tolist(), int(state.gradient_step))
    [0.0, 0.0] 0
    [-2.0, -2.0] 1

  References:
    ``optax.MultiSteps``, whose state and averaging this follows.
  """
  inner = _check_inner(inner, "multi_steps")
  if callable(every_k_schedule):
    schedule = every_k_schedule
  else:
    k = base.check_int("every_k_schedule", every_k_schedule, fn="multi_steps", minimum=1)
    schedule = lambda step: k

  def init_fn(params):
    return MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=inner.init(params),
        acc_grads=jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), _accumulator_dtype(jnp.result_type(p))), params))

  def update_fn(updates, state, params=None, **extra_args):
    k = jnp.asarray(schedule(state.gradient_step), jnp.int32)
    n = state.mini_step.astype(jnp.float32)
    acc = jax.tree.map(lambda g, a: a + (g.astype(a.dtype) - a) / (n + 1).astype(a.dtype),
                       updates, state.acc_grads)
    emit = state.mini_step + 1 >= k

    def run(acc, inner_state):
      mean = jax.tree.map(lambda a, u: a.astype(u.dtype), acc, updates)
      # Not on every call: a non-finite skip's flag is not handed on (commopt._src.finite).
      return inner.update(mean, inner_state, params, **finite.without(extra_args))

    new_updates, inner_state = _run_or_hold(emit, run, acc, state.inner_opt_state)
    return new_updates, MultiStepsState(
        mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
        gradient_step=jnp.where(emit, optax.safe_int32_increment(state.gradient_step),
                                state.gradient_step),
        inner_opt_state=inner_state,
        acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
