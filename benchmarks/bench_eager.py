"""Eager DiLoCo's steps to the target by the weight of each worker's own pseudo-gradient.

``commopt.parallel.eager_diloco`` takes each outer step at once on the estimate
``w·Δₘ + mean(Δ⁻) − w·Δₘ⁻`` of the mean pseudo-gradient (``w = own_weight``). This
benchmark trains ``benchmarks/bench_network.py``'s MLP (64 -> H -> H -> 10 on the
bundled digits, H = ``--hidden``) on ``--workers`` CPU devices of one process, with that
benchmark's batches, momentum SGD inside, 4-bit ``int_quant`` exchanges (``two_phase``)
and ``optax.sgd(1.0)`` outside, for every ``--periods`` H: blocking ``diloco`` and
``eager_diloco`` at each ``--weights`` w. It reports, for the global model (the workers'
mean anchor after each outer step, scored on bench_network's 512 digits), the first step
after which its loss reaches ``--target-loss``, the worst loss after that step (a run that
reaches the target and then oscillates shows it), and the last loss.

No network and no timing: steps to the target times a step's time on a link (from
``bench_network.py``) is the time to the target.

    python benchmarks/bench_eager.py                        # ~5 min on 2 cores
    python benchmarks/bench_eager.py --periods 4,8 --weights 1/M,0.5,1 --steps 40

Writes ``eager.json`` and ``eager.png`` (the global model's loss against the step, one
panel per period) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.data import batch_rows, digits_cnn, eval_rows  # noqa: E402  (after the path)
from harness.plots import pyplot  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workers", type=int, default=4, help="CPU devices, one worker each")
  p.add_argument("--periods", default="3,4,6,8", help="comma-separated H (inner steps)")
  p.add_argument("--weights", default="1/M,1",
                 help="comma-separated own_weight values: 1/M (the default) or numbers in [0, 1]")
  p.add_argument("--steps", type=int, default=60)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--batch", type=int, default=32, help="rows per worker per step")
  p.add_argument("--lr", type=float, default=0.02)
  p.add_argument("--momentum", type=float, default=0.9, help="the inner SGD's momentum")
  p.add_argument("--target-loss", type=float, default=0.3)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  try:
    args.periods = [int(x) for x in args.periods.split(",") if x.strip()]
  except ValueError:
    p.error(f"--periods: comma-separated integers, got {args.periods!r}")
  if not args.periods or min(args.periods) < 1:
    p.error(f"--periods: each period must be at least 1, got {args.periods}")
  weights = []
  for x in (x.strip() for x in args.weights.split(",") if x.strip()):
    try:
      weights.append(None if x == "1/M" else float(x))
    except ValueError:
      p.error(f"--weights: each is 1/M or a number in [0, 1], got {x!r}")
    if weights[-1] is not None and not 0 <= weights[-1] <= 1:
      p.error(f"--weights: each is 1/M or a number in [0, 1], got {x!r}")
  args.weights = weights
  if args.workers < 2:
    p.error(f"--workers must be at least 2, got {args.workers}")
  if args.steps < 2 * max(args.periods):
    p.error(f"--steps must be at least twice the longest period ({2 * max(args.periods)}), "
            f"got {args.steps}")
  return args


def weight_label(w) -> str:
  return "1/M" if w is None else f"{w:g}"


def summarise(losses, target: float) -> dict:
  """Steps to the target, the worst loss from then on, and the last, of ``[(step, loss)]``."""
  hit = next((i for i, (_, loss) in enumerate(losses) if loss <= target), None)
  return {"steps_to_target": None if hit is None else losses[hit][0],
          "worst_after": None if hit is None else max(loss for _, loss in losses[hit:]),
          "last": losses[-1][1]}


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", args.workers)
  import optax

  import commopt

  digits = digits_cnn()
  x_all, y_all = digits.load_digits_flat()
  params0, loss_fn = digits.mlp_fns(args.hidden)
  scored = eval_rows(len(x_all))
  score = jax.jit(loss_fn)
  mesh = jax.make_mesh((args.workers,), ("data",))
  held_out = {"x": x_all[scored], "y": y_all[scored]}

  def batch(step):       # bench_network's rows: worker i takes the i-th share
    idx = batch_rows(len(x_all), step, args.batch * args.workers)
    return {"x": x_all[idx], "y": y_all[idx]}

  def options(period):
    return dict(inner=optax.sgd(args.lr, momentum=args.momentum), outer=optax.sgd(1.0),
                period=period, strategy="two_phase",
                compressor=commopt.compressors.make("int_quant", bits=4))

  def blocking(period):
    dp = commopt.data_parallel(loss_fn, commopt.diloco(axis_name="data", **options(period)),
                               mesh, local_params=True)
    p, s, out = dp.place_params(params0), dp.init(params0), []
    for k in range(args.steps):
      p, s, _ = dp.step(p, s, dp.local_batch(batch(k)))
      if (k + 1) % period == 0:
        out.append((k + 1, float(score(commopt.transforms.global_params(s), held_out))))
    return out

  def eager(period, w):
    run = commopt.parallel.eager_diloco(loss_fn, mesh=mesh, own_weight=w, **options(period))
    p, s, out = run.place_params(params0), run.init(params0), []
    for k in range(args.steps):
      p, s, _ = run.step(p, s, run.local_batch(batch(k)))
      if (k + 1) % period == 0:        # the mean anchor now, without waiting for the exchange
        out.append((k + 1, float(score(run.global_params(s), held_out))))
    run.finish(p, s)
    run.close()
    return out

  rows = []
  for period in args.periods:
    variants = [("blocking", None)] + [("eager", w) for w in args.weights]
    for kind, w in variants:
      t0 = time.perf_counter()
      losses = blocking(period) if kind == "blocking" else eager(period, w)
      row = {"period": period, "method": kind,
             "own_weight": None if kind == "blocking" else weight_label(w),
             "losses": losses, **summarise(losses, args.target_loss)}
      rows.append(row)
      worst = row["worst_after"]
      print(f"  H={period} {kind}{'' if kind == 'blocking' else ' w=' + weight_label(w)}: "
            f"target at step {row['steps_to_target']}, worst after "
            f"{'-' if worst is None else f'{worst:.3f}'}, last {row['last']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  report = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "eager.json").write_text(json.dumps(report, indent=1))
  print(table(rows, args.target_loss))
  plot(rows, args, out / "eager.png")
  return report


def table(rows, target: float) -> str:
  fmt = lambda v: "not reached" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
  lines = [f"| H | method | own_weight | steps to loss {target} | worst loss after | last loss |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['period']} | {r['method']} | {r['own_weight'] or '–'} | "
                 f"{fmt(r['steps_to_target'])} | {fmt(r['worst_after'])} | {fmt(r['last'])} |")
  return "\n".join(lines)


def plot(rows, args, path) -> None:
  plt = pyplot()
  fig, axes = plt.subplots(1, len(args.periods), figsize=(4.5 * len(args.periods), 3.6),
                           squeeze=False, sharey=True)
  for ax, period in zip(axes[0], args.periods):
    for r in (r for r in rows if r["period"] == period):
      steps, losses = zip(*r["losses"])
      label = r["method"] + ("" if r["method"] == "blocking" else f", w={r['own_weight']}")
      ax.plot(steps, losses, marker=".", label=label,
              linestyle="--" if r["method"] == "blocking" else "-")
    ax.axhline(args.target_loss, color="grey", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_title(f"H = {period}")
    ax.set_xlabel("step")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel(f"global model's loss ({args.workers} workers)")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
