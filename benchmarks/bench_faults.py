"""What happens at faults: bad inputs, non-finite values, killed processes, long runs.

Four sections, each measured for real:

1. Bad inputs. Every option of every registered compressor fed a value of the
   wrong type (as :func:`commopt.testing.checks.option_types` feeds them), plus
   hand-written bad calls (a string for ``error_feedback``, a float for
   ``bits``, error feedback on a compressor that refuses it, batches whose
   leaves disagree on their leading size or have 0 rows). A call counts as a
   clear error when it raises ``TypeError`` or ``ValueError`` with a message
   that names the argument; silently wrong when it raises nothing.
2. Non-finite values and overflow. A tiny linear model under
   :func:`commopt.data_parallel` on 8 workers: NaN in one worker's batch, and
   finite gradients large enough to overflow a naive exchange (QSGD near
   1e19, PowerSGD at 1e30, float16 at 6e4 over 8 workers) or the update after
   it (a step size of 1e30). Each injected step is classed: skipped exactly
   (parameters finite and unchanged, ``opt_state.total_notfinite`` up by one),
   applied finite (no overflow happened: parameters finite and the counter
   unchanged; with the relative error of the parameters' mean change against
   the exact step), or wrong (anything else).
3. Processes. A launcher killed with SIGKILL (its workers still alive 5 s later
   are orphans), a worker that raises (seconds until
   :class:`commopt.launch.LaunchError`), a checkpoint save killed mid-way (the
   previous checkpoint restores and verifies, the remains do not restore), and
   a clean save restored and continued (bit-identical to the run that never
   stopped).
4. Soak. N steps of ``compressed_mean(scaled_sign(), axis_name="data")`` under
   ``data_parallel``, with the resident memory's growth between step N/10 and N.

    python benchmarks/bench_faults.py [--steps 2000] [--out runs/bench_faults.json]
    python benchmarks/bench_faults.py --quick
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from commopt.testing.processes import alive  # noqa: E402
from harness.faults import (  # noqa: E402  (after the path)
    ENV, killed_launcher, raising_worker, rss_mib, run_injected, try_call, wait_until)

WORKERS = 8

KILLED_SAVE = ROOT / "tests" / "killed_save_worker.py"


# -- 1. bad inputs --------------------------------------------------------------------


def option_calls():
  """``(label, argument, call)`` for every wrong-type option of every registered compressor,
  built as :func:`commopt.testing.checks.option_types` builds them."""
  from commopt.compressors import DEFAULTS, REGISTRY, make
  from commopt.testing import checks
  calls = []
  for name in sorted(REGISTRY):
    factory = REGISTRY[name]
    for option, param in inspect.signature(factory).parameters.items():
      if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        continue
      registered = DEFAULTS[name].get(option)
      kind, none_ok = checks._option_kind(param, registered)
      if kind is None:
        continue
      valid = next((v for v in (registered, param.default)
                    if v is not None and v is not inspect.Parameter.empty), checks._SAMPLE[kind])
      wrong = checks._WRONG_TYPES[kind](valid) + ([] if none_ok else [None])
      for value in wrong:
        if value is None:   # make reads None as "the default"
          call = lambda f=factory, n=name, o=option: f(**{**DEFAULTS[n], o: None})
        else:
          call = lambda n=name, o=option, v=value: make(n, **{o: v})
        calls.append((f"{name}({option}={value!r})", option, call))
  return calls


def hand_calls(mesh):
  """``(label, argument, call)`` for hand-written bad calls."""
  import jax.numpy as jnp
  import optax

  import commopt

  def step_with(batch):
    tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.1))
    dp = commopt.data_parallel(_loss, tx, mesh, donate=False)
    params = {"w": jnp.zeros((4, 3))}
    out = dp.step(params, dp.init(params), batch)
    import jax
    jax.block_until_ready(out)

  return [
      ('compressed_mean(top_k(0.1), error_feedback="no")', "error_feedback",
       lambda: commopt.compressed_mean(commopt.top_k(0.1), error_feedback="no")),
      ('top_k(ratio="0.1")', "ratio", lambda: commopt.top_k(ratio="0.1")),
      ("top_k(ratio=True)", "ratio", lambda: commopt.top_k(ratio=True)),
      ("int_quant(bits=8.0)", "bits", lambda: commopt.int_quant(bits=8.0)),
      ("compressed_mean(sign(), error_feedback=True)", "error_feedback",
       lambda: commopt.compressed_mean(commopt.sign(), error_feedback=True)),
      ("data_parallel step, leaves of 16 and 8 rows", "batch",
       lambda: step_with({"x": jnp.ones((16, 4)), "y": jnp.ones((8, 3))})),
      ("data_parallel step, 0 rows", "batch",
       lambda: step_with({"x": jnp.ones((0, 4)), "y": jnp.ones((0, 3))})),
  ]


def bad_inputs(mesh, log):
  calls = option_calls() + hand_calls(mesh)
  outcomes = {"clear": 0, "unclear": 0, "silent": 0}
  failures = []
  for label, argument, call in calls:
    outcome = try_call(call, argument)
    outcomes[outcome] += 1
    if outcome != "clear":
      failures.append(f"{label}: {outcome}")
  log(f"bad inputs: {len(calls)} tried, {outcomes['clear']} clear, "
      f"{outcomes['unclear']} unclear, {outcomes['silent']} silent")
  for f in failures:
    log(f"  not clear: {f}")
  return {"tried": len(calls), "clear_errors": outcomes["clear"],
          "unclear_errors": outcomes["unclear"], "silently_wrong": outcomes["silent"],
          "not_clear": failures}


# -- 2. non-finite values and overflow ------------------------------------------------


def _loss(p, b):
  """A linear model whose gradient is the mean of the worker's rows of ``x``, whatever ``w``."""
  import jax.numpy as jnp
  return jnp.sum(jnp.mean(b["x"] @ p["w"] - b["y"], axis=0))


def nonfinite(mesh, steps, log):
  import jax
  import jax.numpy as jnp
  import optax

  import commopt

  key = jax.random.key(0)
  x = jax.random.normal(key, (WORKERS * 2, 32))
  y = jnp.zeros((WORKERS * 2, 64))
  w = 0.1 * jax.random.normal(jax.random.key(1), (32, 64))
  nan_steps = {2, steps - 2}
  big = {1}
  rows_per_worker = 2

  def nan_batch(i):
    if i not in nan_steps:
      return {"x": x, "y": y}
    return {"x": x.at[3 * rows_per_worker, 5].set(jnp.nan), "y": y}   # worker 3 only

  def scaled(scale, dtype=jnp.float32):
    """Ordinary rows, and on the injected step rows of ``scale``: every gradient entry is
    ``scale`` on every worker, finite in ``dtype``."""
    return lambda i: {"x": (jnp.full_like(x, scale) if i in big else x).astype(dtype),
                      "y": y.astype(dtype)}

  def dp_of(compressor, lr=0.1, **kw):
    tx = optax.chain(commopt.compressed_mean(compressor, axis_name="data", **kw), optax.sgd(lr))
    return commopt.data_parallel(_loss, tx, mesh, donate=False)

  cases = [
      ("NaN in worker 3's batch (scaled_sign)", dp_of(commopt.scaled_sign(), min_size=0),
       {"w": w}, nan_batch, nan_steps, steps, None),
      ("NaN in worker 3's batch (dense mean)", dp_of(commopt.scaled_sign(), min_size=10 ** 9),
       {"w": w}, nan_batch, nan_steps, steps, None),
      ("qsgd, gradients near 1e19", dp_of(commopt.qsgd(), min_size=0),
       {"w": w}, scaled(1e19), big, 3, -0.1 * 1e19),
      ("power_sgd(rank=1), gradients at 1e30", dp_of(commopt.power_sgd(rank=1), min_size=0),
       {"w": w}, scaled(1e30), big, 3, -0.1 * 1e30),
      ("cast('float16'), 6e4 on 8 workers", dp_of(commopt.cast("float16"), min_size=0),
       {"w": w}, scaled(6e4), big, 3, -0.1 * 6e4),
      ("float16 dense mean, 6e4 on 8 workers", dp_of(commopt.scaled_sign(), min_size=10 ** 9),
       {"w": (0.01 * w).astype(jnp.float16)}, scaled(6e4, jnp.float16), big, 3, -0.1 * 6e4),
      ("update overflows after the exchange (sgd 1e30)", dp_of(commopt.scaled_sign(), lr=1e30,
                                                                min_size=0),
       {"w": w}, scaled(1e20), big, 3, None),
  ]
  rows = []
  for label, dp, params, batch, injected, n, expected in cases:
    counts = run_injected(dp, params, batch, injected, n, expected)
    rows.append({"case": label, "injected": len(injected), "skipped_exactly": counts["skipped"],
                 "applied_finite": counts["applied_finite"], "wrong": counts["wrong"],
                 "applied_rel_error": counts["rel_error"]})
    log(f"non-finite: {label}: {rows[-1]}")
  return rows


# -- 3. processes ---------------------------------------------------------------------


def killed_save(work: pathlib.Path, mesh, log):
  import jax.numpy as jnp
  import numpy as np

  from commopt import checkpoint
  out = work / "save"
  out.mkdir()
  script = KILLED_SAVE
  with open(work / "save_log.txt", "wb") as f:
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=ENV, stdout=f,
                            stderr=subprocess.STDOUT)
    try:
      stalled = wait_until(lambda: (out / "stalled").exists(), proc, 240)
    finally:
      proc.kill()
      proc.wait()
  ok = stalled and not (out / "step_2").exists()
  dp = _ck_dp(mesh)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  if stalled:
    temporary = pathlib.Path((out / "stalled").read_text())
    try:
      checkpoint.restore(temporary, dp, params)
      ok = False   # the remains must not restore
    except (checkpoint.CorruptCheckpointError, ValueError):
      pass
  try:
    got = checkpoint.restore(out / "step_1", dp, params)
    previous = got.step == 1 and np.array_equal(np.asarray(got.params["w"]),
                                                np.full((64, 48), 0.5, np.float32))
  except Exception as e:   # noqa: BLE001 - reported
    log(f"processes: previous checkpoint did not restore: {e}")
    previous = False
  log(f"processes: save killed mid-way: stalled={stalled}, previous restores={previous}")
  return {"case": "checkpoint save killed mid-way", "killed": 1, "workers": 1,
          "resumed_bit_identical": None, "previous_restores": previous, "orphans":
          int(alive(proc.pid)), "ok": ok and previous}


def _ck_dp(mesh):
  import jax.numpy as jnp
  import optax

  import commopt
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data", min_size=0),
                   optax.sgd(0.2, momentum=0.9))
  return commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2),
                               tx, mesh, donate=False)


def clean_resume(work: pathlib.Path, mesh, log):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from commopt import checkpoint
  dp = _ck_dp(mesh)
  params = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
  batches = [{"x": jax.random.normal(jax.random.key(i), (24, 64)),
              "y": jax.random.normal(jax.random.key(100 + i), (24, 48))} for i in range(5)]
  p, s = params, dp.init(params)
  for b in batches[:2]:
    p, s, _ = dp.step(p, s, b)
  checkpoint.save(work / "clean", p, s, step=2)
  got = checkpoint.restore(work / "clean", dp, params)
  p2, s2 = got.params, got.opt_state
  for b in batches[2:]:
    p, s, _ = dp.step(p, s, b)
    p2, s2, _ = dp.step(p2, s2, b)
  host = lambda t: [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(t)]
  same = all(np.array_equal(a, b) for a, b in zip(host((p, s)), host((p2, s2))))
  log(f"processes: clean save, restore, 3 more steps: bit-identical={same}")
  return {"case": "restore after a clean save, 3 more steps", "killed": 0, "workers": 1,
          "resumed_bit_identical": same, "orphans": 0, "ok": same}


def processes(mesh, log):
  work = pathlib.Path(tempfile.mkdtemp(prefix="bench_faults_"))
  try:
    return [killed_launcher(work, log), raising_worker(work, log), killed_save(work, mesh, log),
            clean_resume(work, mesh, log)]
  finally:
    shutil.rmtree(work, ignore_errors=True)


# -- 4. soak --------------------------------------------------------------------------


def soak(mesh, steps, log):
  import jax
  import jax.numpy as jnp
  import optax

  import commopt
  tx = optax.chain(commopt.compressed_mean(commopt.scaled_sign(), axis_name="data"), optax.sgd(0.01))
  dp = commopt.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), tx, mesh)
  params = {"w": jnp.zeros((256, 64))}
  state = dp.init(params)
  batch = {"x": jax.random.normal(jax.random.key(0), (WORKERS * 4, 256)),
           "y": jax.random.normal(jax.random.key(1), (WORKERS * 4, 64))}
  first = max(1, steps // 10)
  t0, start = time.perf_counter(), None
  for i in range(1, steps + 1):
    params, state, losses = dp.step(params, state, batch)
    if i == first:
      jax.block_until_ready(losses)
      start = rss_mib()
    if i % max(1, steps // 5) == 0:
      log(f"soak: step {i}/{steps}")
  jax.block_until_ready((params, state))
  end = rss_mib()
  row = {"steps": steps, "from_step": first, "rss_start_mib": start, "rss_end_mib": end,
         "rss_growth_mib": end - start, "seconds": time.perf_counter() - t0,
         "skipped": int(state.total_notfinite)}
  log(f"soak: {row}")
  return row


# -- main -----------------------------------------------------------------------------


def print_table(result):
  b = result["bad_inputs"]
  print("\n1. Bad inputs")
  print(f"{'tried':>6} {'clear errors':>13} {'unclear errors':>15} "
        f"{'silently wrong (must be 0)':>27}")
  print(f"{b['tried']:6d} {b['clear_errors']:13d} {b['unclear_errors']:15d} "
        f"{b['silently_wrong']:27d}")
  rows = result["nonfinite"]
  w = max(len(r["case"]) for r in rows)
  print("\n2. Non-finite and overflow injections (data_parallel, 8 workers)")
  print(f"{'case':<{w}} {'injected':>8} {'skipped exactly':>16} {'applied finite':>15} "
        f"{'wrong (must be 0)':>18} {'applied: error of mean step':>28}")
  for r in rows:
    err = "-" if r["applied_rel_error"] is None else f"{r['applied_rel_error']:.1e}"
    print(f"{r['case']:<{w}} {r['injected']:8d} {r['skipped_exactly']:16d} "
          f"{r['applied_finite']:15d} {r['wrong']:18d} {err:>28}")
  rows = result["processes"]
  w = max(len(r["case"]) for r in rows)
  print("\n3. Processes")
  print(f"{'case':<{w}} {'killed':>6} {'resumed bit-identical':>22} {'orphans (must be 0)':>20} "
        f"{'as promised':>12}")
  for r in rows:
    resumed = {None: "-", True: "yes", False: "NO"}[r["resumed_bit_identical"]]
    if "previous_restores" in r:
      resumed = "previous one: " + ("yes" if r["previous_restores"] else "NO")
    extra = (f"  LaunchError after {r['seconds_to_launch_error']:.2f} s"
             if r.get("seconds_to_launch_error") is not None else "")
    print(f"{r['case']:<{w}} {r['killed']:6d} {resumed:>22} {r['orphans']:20d} "
          f"{'yes' if r['ok'] else 'NO':>12}{extra}")
  s = result["soak"]
  print(f"\n4. Soak: {s['steps']} steps of compressed_mean(scaled_sign(), axis_name='data'): RSS "
        f"{s['rss_start_mib']:.1f} MiB at step {s['from_step']} -> {s['rss_end_mib']:.1f} MiB "
        f"at step {s['steps']}, growth {s['rss_growth_mib']:+.1f} MiB ({s['seconds']:.1f} s)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="small counts, for the smoke test")
  p.add_argument("--steps", type=int, default=None,
                 help="soak steps (default 2000; 200 with --quick)")
  p.add_argument("--skip-processes", action="store_true", help="leave out section 3")
  p.add_argument("--out", default=str(ROOT / "runs" / "bench_faults.json"))
  args = p.parse_args(argv)
  steps = args.steps or (200 if args.quick else 2000)
  nan_steps = 6 if args.quick else 20

  import jax
  jax.config.update("jax_num_cpu_devices", WORKERS)
  mesh = jax.make_mesh((WORKERS,), ("data",), devices=jax.devices()[:WORKERS])
  t0 = time.perf_counter()
  log = lambda m: print(f"[{time.perf_counter() - t0:6.1f} s] {m}", flush=True)

  result = {"bad_inputs": bad_inputs(mesh, log), "nonfinite": nonfinite(mesh, nan_steps, log)}
  result["processes"] = [] if args.skip_processes else processes(mesh, log)
  result["soak"] = soak(mesh, steps, log)
  if not result["processes"]:
    result["processes"] = [{"case": "(left out)", "killed": 0, "resumed_bit_identical": None,
                            "orphans": 0, "ok": True}]
  print_table(result)
  result["meta"] = {"quick": args.quick, "backend": jax.default_backend(), "workers": WORKERS,
                    "jax": jax.__version__, "machine": platform.machine(),
                    "seconds": time.perf_counter() - t0, "argv": sys.argv[1:]}
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(f"wrote {out}")
  return result


if __name__ == "__main__":
  main()
