"""The α-β network model (``commopt.sim.network``) against a measured ``bench_network`` run.

For every shaped bandwidth, process count and method of a
``bench_network.py`` report, the model prices the method's communication
plan (``commopt.wire.comm_plan`` of the same reducer on the same MLP) on one
shared link of that rate, every process's bytes crossing it, as the
benchmark's one shaped loopback carries them, with ``--latency`` seconds
per message. It adds the measured compute to predict the step, and prints
predicted against measured communication and step times with their relative
error, as a table (``network_model.md``) and JSON. It also fits the
per-message latency that best explains the measured communication (least
squares; the model is linear in ``α``) and gives the error at that ``α``. The
unshaped loopback has no rate to give the model and is left out.

    python benchmarks/network_model.py --from-json benchmarks/results/network.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.netns import rate_bits  # noqa: E402  (after the path)
from harness.trainers import METHODS  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--from-json", default=str(ROOT / "benchmarks" / "results" / "network.json"),
                 help="a bench_network.py report")
  p.add_argument("--latency", type=float, default=5e-5,
                 help="α: seconds per message on the loopback (gloo over TCP)")
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  return p.parse_args(argv)


def mlp_shapes(hidden: int):
  """The benchmark MLP's parameters, as shapes (nothing allocated)."""
  import jax
  import jax.numpy as jnp
  sizes = [(64, hidden), (hidden, hidden), (hidden, 10)]
  return {f"l{i}": {"w": jax.ShapeDtypeStruct(s, jnp.float32),
                    "b": jax.ShapeDtypeStruct((s[1],), jnp.float32)}
          for i, s in enumerate(sizes)}


def main(argv=None):
  args = parse_args(argv)
  report = json.loads(pathlib.Path(args.from_json).read_text())
  if "skipped" in report:
    print(f"network_model: {args.from_json} measured nothing: {report['skipped']}")
    return {}
  import commopt
  from commopt.sim import network
  params = mlp_shapes(report["config"]["hidden"])
  rows, errors = [], {"comm": [], "step": []}
  runs = []          # (measured comm, the model's bytes term, its messages)
  for n, by_bw in report["results"].items():
    for bw, methods in by_bw.items():
      if bw == "unlimited":
        continue
      gbit = rate_bits(bw) / 1e9
      shared = lambda latency: network.Network(network.Link.gbit(gbit, latency), topology="shared")
      for label, r in methods.items():
        if label not in METHODS:   # DiLoCo combinations and the PyTorch peer
          continue
        name, opts, strategy, ef = METHODS[label]
        reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name="data",
                                          strategy=strategy, error_feedback=ef)
        pred = network.predict(reducer, params, int(n), shared(args.latency),
                               compute_s=r["compute_s"])
        bytes_term = network.predict(reducer, params, int(n), shared(0.0)).comm_s
        messages = network.predict(reducer, params, int(n), shared(1.0)).comm_s - bytes_term
        runs.append((r["comm_s"], bytes_term, messages))
        comm_err = (pred.comm_s - r["comm_s"]) / r["comm_s"] if r["comm_s"] > 0 else None
        step_err = (pred.step_s - r["step_s"]) / r["step_s"]
        if comm_err is not None:
          errors["comm"].append(abs(comm_err))
        errors["step"].append(abs(step_err))
        rows.append(dict(processes=int(n), bandwidth=bw, method=label,
                         sent_bytes=pred.sent_bytes, predicted_comm_s=pred.comm_s,
                         measured_comm_s=r["comm_s"], comm_error=comm_err,
                         predicted_step_s=pred.step_s, measured_step_s=r["step_s"],
                         step_error=step_err))
  pct = lambda e: "-" if e is None else f"{100 * e:+.0f}%"
  lines = ["| processes | bandwidth | method | MB sent/worker | comm ms predicted | measured | "
           "error | step ms predicted | measured | error |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['processes']} | {r['bandwidth']} | {r['method']} | "
                 f"{r['sent_bytes'] / 1e6:.2f} | {r['predicted_comm_s'] * 1e3:.1f} | "
                 f"{r['measured_comm_s'] * 1e3:.1f} | {pct(r['comm_error'])} | "
                 f"{r['predicted_step_s'] * 1e3:.1f} | {r['measured_step_s'] * 1e3:.1f} | "
                 f"{pct(r['step_error'])} |")
  med = {k: statistics.median(v) if v else None for k, v in errors.items()}
  # The α that fits the measured communication best: min Σ (bytes + m·α − measured)².
  fit = max(0.0, sum(m * (c - b) for c, b, m in runs) / max(sum(m * m for _, _, m in runs), 1e-30))
  fit_errors = [abs(b + m * fit - c) / c for c, b, m in runs if c > 0]
  med["comm_at_fitted_latency"] = statistics.median(fit_errors) if fit_errors else None
  summary = (f"Shared link, α = {args.latency * 1e6:.0f} µs per message. Median absolute error: "
             f"communication {pct(med['comm'])}, step {pct(med['step'])} over {len(rows)} runs. "
             f"The α that fits the measured communication best is {fit * 1e6:.0f} µs per "
             f"message; with it the median absolute communication error is "
             f"{pct(med['comm_at_fitted_latency'])}.")
  text = "\n".join(lines) + "\n\n" + summary
  print(text)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "network_model.md").write_text(text + "\n")
  (out / "network_model.json").write_text(json.dumps(
      {"latency": args.latency, "fitted_latency": fit, "rows": rows, "median_abs_error": med},
      indent=1))
  print(f"wrote {out / 'network_model.md'} and {out / 'network_model.json'}")
  return {"rows": rows, "median_abs_error": med, "fitted_latency": fit}


if __name__ == "__main__":
  main()
