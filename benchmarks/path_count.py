"""How much of commopt one step's lowering walks through: calls, modules, module switches.

The step is ``commopt.data_parallel(loss, optax.chain(commopt.compressed_mean(
commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1)), mesh, axis_name="data")`` on a
small MLP (32 -> 64 -> 16; both weights compressed, the biases under ``min_size`` sent
dense), over a 1-D mesh ``("data",)`` of 4 simulated CPU devices. ``dp.init(params)``
runs first, uncounted: it traces ``tx`` to find the state's layout (the layout probe),
which the step then reads from its cache. What is counted is everything the one call
``dp.lower(params, opt_state, batch)`` runs in this thread, from its call to its return:
placing the arguments, tracing the step (the step body, the transform, the compressor,
the collectives) and lowering it to StableHLO; nothing is compiled or run.

A ``sys.setprofile`` hook sees every Python ``call`` and ``return`` event in that time
(calls into C are not events of their own). A frame belongs to the module whose
``__name__`` its globals hold; a commopt module is ``commopt`` or ``commopt.*``.

- **calls**: ``call`` events into frames of commopt modules (a generator's resumption
  is a call too).
- **modules**: the distinct commopt modules those calls entered.
- **switches**: how many of those calls enter a different commopt module from the one the
  call before it entered: the walk read as the sequence of commopt modules its calls go
  into, a switch wherever that sequence changes module. Calls from JAX or optax back into
  commopt count as the calls they are; returns are not counted (each switch has its way
  back, so counting both would about double the figure).

    python benchmarks/path_count.py                  # the table and the modules entered
    python benchmarks/path_count.py --json /tmp/path_count.json --check

``--check`` exits 1 unless modules <= 16 and switches <= 300 (:data:`TARGETS`).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

WORKERS = 4
TARGETS = {"modules": 16, "switches": 300}
"""The most modules and switches the step's lowering may take (``--check``)."""


def commopt_module(frame) -> str | None:
  """The commopt module ``frame`` runs in, or None for another module's frame."""
  name = frame.f_globals.get("__name__") or ""
  return name if name == "commopt" or name.startswith("commopt.") else None


class PathCounter:
  """A ``sys.setprofile`` hook counting calls into commopt modules and switches between them
  (see the module's docstring); use it as a context manager around what to count."""

  def __init__(self):
    self.calls: collections.Counter = collections.Counter()
    self.switches = 0
    self._last: str | None = None

  def _profile(self, frame, event, arg):
    del arg
    if event == "call":
      module = commopt_module(frame)
      if module is not None:
        self.calls[module] += 1
        self._move(module)

  def _move(self, module: str) -> None:
    if self._last is not None and module != self._last:
      self.switches += 1
    self._last = module

  def __enter__(self):
    sys.setprofile(self._profile)
    return self

  def __exit__(self, *exc):
    sys.setprofile(None)
    return False

  def result(self) -> dict:
    """``{"calls", "modules", "switches", "by_module"}``, ``by_module`` the calls into each
    module entered, most first."""
    by_module = dict(sorted(self.calls.items(), key=lambda kv: (-kv[1], kv[0])))
    return {"calls": sum(by_module.values()), "modules": len(by_module),
            "switches": self.switches, "by_module": by_module}


def build(workers: int = WORKERS):
  """``(dp, params, opt_state, batch)``: the step on the first ``workers`` devices, its
  state already initialised (the layout probe has run)."""
  import jax
  import jax.numpy as jnp
  import optax

  import commopt

  mesh = jax.make_mesh((workers,), ("data",), devices=jax.devices()[:workers])
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1, "b1": jnp.zeros((64,)),
            "w2": jax.random.normal(k2, (64, 16)) * 0.1, "b2": jnp.zeros((16,))}
  batch = {"x": jax.random.normal(k3, (8 * workers, 32)),
           "y": jnp.zeros((8 * workers, 16))}

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)

  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"),
                   optax.sgd(0.1))
  dp = commopt.data_parallel(loss, tx, mesh, axis_name="data")
  return dp, params, dp.init(params), batch


def count(workers: int = WORKERS) -> dict:
  """The counts of one ``dp.lower(params, opt_state, batch)`` (see the module's docstring)."""
  dp, params, opt_state, batch = build(workers)
  with PathCounter() as counter:
    dp.lower(params, opt_state, batch)
  return counter.result()


def table(result: dict) -> str:
  rows = [("calls", result["calls"], "")]
  rows += [(k, result[k], f"<= {TARGETS[k]}") for k in ("modules", "switches")]
  lines = [f"{'':10} {'count':>8}  target"]
  lines += [f"{name:10} {value:8d}  {target}" for name, value, target in rows]
  lines += ["", "modules entered, by calls:"]
  lines += [f"  {calls:7d}  {module}" for module, calls in result["by_module"].items()]
  return "\n".join(lines)


def missed(result: dict) -> list[str]:
  """The targets ``result`` misses, as lines."""
  return [f"{k}: {result[k]} > {limit}" for k, limit in TARGETS.items() if result[k] > limit]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", default=None, metavar="PATH", help="also write the counts here")
  p.add_argument("--check", action="store_true",
                 help=f"exit 1 unless modules <= {TARGETS['modules']} and switches <= "
                      f"{TARGETS['switches']}")
  args = p.parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", WORKERS)
  result = count(WORKERS)
  print(table(result))
  if args.json:
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "targets": TARGETS}, indent=2) + "\n")
  if args.check:
    misses = missed(result)
    for line in misses:
      print(f"missed: {line}", file=sys.stderr)
    return 1 if misses else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
