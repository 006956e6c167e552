"""Timed calls and rounds of them: what a benchmark reports as a call's or a step's time.

Every call is blocked until its result is ready. A machine shared with other work slows
some spells down: :func:`interleaved` times rows in rounds, one after another, so that a
slow spell hits every row of a round alike, and :func:`ratio` compares two rows round by
round (:func:`round_medians` splits a run of steps into its rounds).
"""

from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeats: int) -> float:
  """The median wall time of ``fn()`` (its result blocked until ready, as a JAX array's) over
  ``repeats`` calls after one warm-up call (which compiles); of an even count, the higher of
  the middle two."""
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median_high(times)


def device_seconds(fn, repeats: int, batch: int = 10) -> float:
  """Median over ``repeats`` batches of the time per call of ``batch`` calls of ``fn()``
  queued back to back and blocked once: the device's time per call, without the host's
  dispatch latency (which would otherwise dominate sub-millisecond kernels); of an even
  count, the higher of the middle two."""
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(batch):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / batch)
  return statistics.median_high(times)


def runner(step, p, s, batch, clock=time.perf_counter):
  """``run(n)``: the median seconds by ``clock`` of ``n`` more steps of ``step(p, s, batch)``,
  each blocked until ready, going on from where the last call left off (``bench_step.py``
  and ``bench_base.py`` time their rows with it)."""
  import jax
  state = [p, s]

  def run(n):
    times = []
    for _ in range(n):
      t0 = clock()
      state[0], state[1], _ = jax.block_until_ready(step(state[0], state[1], batch)[:3])
      times.append(clock() - t0)
    return statistics.median(times)
  return run


def interleaved(runs: dict, rounds: int, steps: int) -> dict:
  """``{label: [each round's median seconds]}``: every run in ``runs`` for ``steps`` steps
  per round, one after the other, for ``rounds`` rounds, in the given order in even rounds
  and the reverse in odd ones (so that no row always runs first)."""
  out = {label: [] for label in runs}
  for r in range(rounds):
    for label, run in (list(runs.items()) if r % 2 == 0 else reversed(list(runs.items()))):
      out[label].append(run(steps))
  return out


def ratio(times, base) -> float:
  """The median over the rounds of ``times[r] / base[r]``."""
  return statistics.median(t / b for t, b in zip(times, base))


def round_medians(times, steps: int) -> list:
  """Each round's median of ``times``, ``steps`` consecutive step times a round."""
  return [statistics.median(times[i:i + steps]) for i in range(0, len(times), steps)]


def per_step(times, period: int = 1) -> float:
  """A typical step: the median of ``times``; for a method that exchanges every ``period`` steps,
  the median over consecutive runs of ``period`` steps (each holding one exchange) of their mean."""
  if period <= 1:
    return statistics.median(times)
  runs = [times[i:i + period] for i in range(0, len(times) - period + 1, period)]
  return statistics.median(sum(r) / period for r in runs) if runs else sum(times) / len(times)
