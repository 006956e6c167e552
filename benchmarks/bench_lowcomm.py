"""The newest low-communication methods against their dense baselines: loss against bytes.

On the character-level language model of ``examples/zero_lm.py`` (115k parameters,
the offline docstring corpus) and on the digits CNN of ``examples/digits_cnn.py``
(1.07M parameters), over ``--workers`` simulated CPU devices, every method from the
same parameters on the same batches (each worker its own rows):

- ``AdamW DP``: the mean gradient every step (an identity ``compressed_mean``), AdamW;
- ``DeMo``: ``commopt.demo`` (k = 32 of each 64 x 64 tile of DCT coefficients, momentum
  decay 0.999, sign step) every step, no dense exchange at all;
- ``DiLoCo``: AdamW inside, DiLoCo's Nesterov outer step (0.7, 0.9), dense
  pseudo-gradients every ``--period`` steps;
- ``DiLoCo int8``: the same with ``int_quant(bits=8)`` pseudo-gradients (two-phase);
- ``SparseLoCo``: ``commopt.transforms.sparseloco`` (k = 64 of each 64 x 64 tile, 2-bit values,
  error feedback decaying at 0.95, outer ``sgd(1.0)``), same H;
- ``MuLoCo``: DiLoCo with ``optax.contrib.muon`` inside (the matrices; AdamW's rule for
  the rest), dense, same H and outer step;
- ``MuLoCo SparseLoCo``: Muon inside, SparseLoCo's exchange.

Bytes are what one worker puts into the collectives (the payload, ``contributed``)
and what it sends under the ring model (``sent``), from ``commopt.wire.comm_plan``
of each method's exchange, summed over the steps that exchange. The table gives the
final training loss (mean of the last tenth of the steps), the held-out loss of the
global model (the parameters; the anchor for the DiLoCo family), the bytes, the byte
ratio against the method's dense baseline (DeMo against AdamW DP, the compressed
DiLoCo family against dense DiLoCo, MuLoCo's against dense MuLoCo) and the final
loss ratio against the same baseline.

    python benchmarks/bench_lowcomm.py                      # both problems, ~10 min on 2 cores
    python benchmarks/bench_lowcomm.py --problems lm --steps 150 --methods "AdamW DP,DeMo"
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBLEMS = ("lm", "cnn")
METHODS = ("AdamW DP", "DeMo", "DiLoCo", "DiLoCo int8", "SparseLoCo", "MuLoCo",
           "MuLoCo SparseLoCo")
BASELINE = {"DeMo": "AdamW DP", "DiLoCo int8": "DiLoCo", "SparseLoCo": "DiLoCo",
            "MuLoCo": "DiLoCo", "MuLoCo SparseLoCo": "MuLoCo"}
"""The dense run each method's bytes and loss are compared with."""

SETTINGS = {"lm": {"steps": 600, "lr": 1e-2, "demo_lr": 5e-3, "batch": 32},
            "cnn": {"steps": 300, "lr": 2e-3, "demo_lr": 1e-3, "batch": 128}}
"""Per problem: steps, AdamW's peak learning rate (also the inner one), DeMo's, global batch."""


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--problems", default=",".join(PROBLEMS), help=f"comma-separated: {PROBLEMS}")
  p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {METHODS}")
  p.add_argument("--workers", type=int, default=4)
  p.add_argument("--steps", type=int, default=None,
                 help="training steps (default per problem: lm 600, cnn 300; a multiple of "
                      "--period)")
  p.add_argument("--period", type=int, default=15, help="H: inner steps between exchanges")
  p.add_argument("--lr", type=float, default=None,
                 help="AdamW's (and the inner optimizers') peak learning rate (default per "
                      "problem: lm 1e-2, cnn 2e-3)")
  p.add_argument("--demo-lr", type=float, default=None,
                 help="DeMo's peak learning rate (default per problem: lm 5e-3, cnn 1e-3)")
  p.add_argument("--demo-decay", type=float, default=0.999, help="DeMo's momentum decay")
  p.add_argument("--demo-combine", default="senders", choices=("mean", "senders"),
                 help="DeMo's mean of the gathered coefficients: over all workers or over "
                      "each coefficient's senders")
  p.add_argument("--demo-k", type=int, default=32,
                 help="DeMo's DCT coefficients sent per tile")
  p.add_argument("--demo-chunk", type=int, default=64, help="DeMo's tile side")
  p.add_argument("--demo-min-size", type=int, default=None,
                 help="DeMo's smallest leaf sent compressed (smaller ones are averaged "
                      "dense, with no momentum; default: commopt's)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
  args = p.parse_args(argv)
  args.problems = [m.strip() for m in args.problems.split(",") if m.strip()]
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  for flag, got, valid in (("--problems", args.problems, PROBLEMS),
                           ("--methods", args.methods, METHODS)):
    bad = [m for m in got if m not in valid]
    if bad:
      p.error(f"{flag}: unknown {bad}; valid: {list(valid)}")
  if args.steps is not None and args.steps % args.period:
    p.error(f"--steps ({args.steps}) must be a multiple of --period ({args.period}), so every "
            "run ends on an exchange")
  return args


def schedule(peak: float, steps: int):
  import optax
  return optax.warmup_cosine_decay_schedule(0.0, peak, min(10, steps // 2), steps, peak / 10)


def muon_dimensions(params):
  """Muon's dimension numbers: the matrices (a stacked block's as a batch of them); None,
  AdamW's rule, for vectors, the embeddings and the output head."""
  import jax
  from optax.contrib import MuonDimensionNumbers as D

  def spec(path, x):
    name = jax.tree_util.keystr(path)
    if x.ndim == 3 and "blocks" in name:
      return D(reduction_axis=1, output_axis=2)
    if x.ndim == 2 and not any(s in name for s in ("embed", "pos", "head", "fc2")):
      return D(0, 1)
    if x.ndim == 4:                       # a convolution's HWIO kernel: (H·W·I) x O
      return D(reduction_axis=(0, 1, 2), output_axis=3)
    return None

  return jax.tree_util.tree_map_with_path(spec, params)


def make(method: str, args, setting, params):
  """(optax transform, whether parameters are per worker)."""
  import optax
  from optax.contrib import muon

  import commopt
  steps, h = setting["steps"], args.period
  lr = schedule(setting["lr"], steps)
  adamw = lambda: optax.adamw(lr, weight_decay=1e-4)
  if method == "AdamW DP":
    return optax.chain(commopt.compressed_mean(commopt.compressors.make("identity"),
                                               axis_name="data"), adamw()), False
  if method == "DeMo":
    return commopt.demo(schedule(setting["demo_lr"], steps), axis_name="data",
                        decay=args.demo_decay, combine=args.demo_combine,
                        k=args.demo_k, chunk=args.demo_chunk,
                        **({} if args.demo_min_size is None else
                           {"min_size": args.demo_min_size}),
                        weight_decay=1e-4), False
  inner = adamw() if not method.startswith("MuLoCo") else muon(
      lr, consistent_rms=0.2, weight_decay=1e-4, adam_weight_decay=1e-4,
      muon_weight_dimension_numbers=muon_dimensions(params))
  if method.endswith("SparseLoCo"):
    return commopt.transforms.sparseloco(inner, axis_name="data", period=h), True
  if method == "DiLoCo int8":
    return commopt.diloco(inner, axis_name="data", period=h,
                          compressor=commopt.int_quant(bits=8), strategy="two_phase"), True
  return commopt.diloco(inner, axis_name="data", period=h), True


def problem(name: str, args):
  """(params, loss_fn, draw(rng) -> global batch, held-out loss of a global model)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  sys.path.insert(0, str(ROOT / "examples"))
  if name == "lm":
    from sharded_lm import docstrings, encode, windows
    from zero_lm import init_params, whole_loss
    cfg = argparse.Namespace(width=64, layers=2, seq_len=64, seed=args.seed)
    train_ids, test_ids, chars = encode(docstrings())
    params, loss = init_params(len(chars), cfg), whole_loss(heads=4)
    starts = np.linspace(0, len(test_ids) - 65, 256).astype(int)
    test = {k: jnp.asarray(v) for k, v in windows(test_ids, starts, 64).items()}

    def draw(rng, batch):
      return windows(train_ids, rng.integers(0, len(train_ids) - 65, batch), 64)

    held = jax.jit(lambda p: loss(p, test))
    return params, loss, draw, held
  from digits_cnn import load_digits_split, model_fns
  x_train, y_train, x_test, y_test = load_digits_split(args.seed)
  params, _, loss = model_fns(args.seed)
  params = jax.tree.map(np.asarray, params)

  def draw(rng, batch):
    idx = rng.choice(len(x_train), batch, replace=False)
    return {"x": x_train[idx], "y": y_train[idx]}

  held = jax.jit(lambda p: loss(p, {"x": x_test, "y": y_test}))
  return params, loss, draw, held


def run(name: str, args) -> dict:
  import jax
  import numpy as np
  from tqdm.auto import tqdm

  import commopt
  from commopt import wire
  setting = dict(SETTINGS[name])
  for key in ("steps", "lr", "demo_lr"):
    if getattr(args, key) is not None:
      setting[key] = getattr(args, key)
  setting["steps"] -= setting["steps"] % args.period
  params, loss_fn, draw, held = problem(name, args)
  mesh = jax.make_mesh((args.workers,), ("data",), devices=jax.devices()[:args.workers])
  results = {}
  for method in args.methods:
    tx, local = make(method, args, setting, params)
    plan = wire.comm_plan(tx, params, args.workers)
    dp = commopt.data_parallel(loss_fn, tx, mesh, local_params=local)
    p, state = dp.place_params(params), dp.init(params)
    rng = np.random.default_rng(args.seed)          # the same batches for every method
    losses, contributed, sent = [], [0], [0.0]
    began = time.perf_counter()
    for step in tqdm(range(setting["steps"]), desc=f"{name} {method}", leave=False,
                     file=sys.stdout):
      p, state, loss = dp.step(p, state, draw(rng, setting["batch"]))
      losses.append(float(np.mean(loss)))
      exchanged = not local or (step + 1) % args.period == 0
      contributed.append(contributed[-1] + (plan.contributed_bytes if exchanged else 0))
      sent.append(sent[-1] + (plan.sent_bytes if exchanged else 0.0))
    seconds = time.perf_counter() - began
    model = state.inner_state.anchor if local else p
    model = jax.tree.map(lambda x: np.asarray(x, np.float32), model)
    tail = losses[-max(1, len(losses) // 10):]
    results[method] = {"losses": losses, "contributed": contributed[1:], "sent": sent[1:],
                       "final_loss": float(np.mean(tail)), "held_out": float(held(model)),
                       "seconds": seconds}
    print(f"{name:>4} {method:>18}: loss {results[method]['final_loss']:.4f}  held-out "
          f"{results[method]['held_out']:.4f}  {contributed[-1] / 1e6:8.3f} MB in  "
          f"{sent[-1] / 1e6:8.3f} MB sent per worker  {seconds:5.1f} s", flush=True)
  for method, r in results.items():
    base = results.get(BASELINE.get(method, ""))
    r["baseline"] = BASELINE.get(method) if base else None
    r["bytes_ratio"] = base["contributed"][-1] / r["contributed"][-1] if base else None
    r["sent_ratio"] = base["sent"][-1] / r["sent"][-1] if base else None
    r["loss_ratio"] = r["final_loss"] / base["final_loss"] if base else None
    r["held_out_ratio"] = r["held_out"] / base["held_out"] if base else None
  return {"setting": setting, "results": results}


def table(name: str, out: dict, args) -> str:
  s = out["setting"]
  lines = [f"**{name}**: {args.workers} workers, {s['steps']} steps, H = {args.period}, "
           f"global batch {s['batch']}.", "",
           "| method | final loss | held-out | MB in / worker | MB sent / worker (ring) | "
           "vs | × fewer bytes in | × fewer sent | loss ratio | held-out ratio |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda v, f: "-" if v is None else format(v, f)
  for method, r in out["results"].items():
    lines.append(
        f"| {method} | {r['final_loss']:.4f} | {r['held_out']:.4f} | "
        f"{r['contributed'][-1] / 1e6:.3f} | {r['sent'][-1] / 1e6:.3f} | "
        f"{r['baseline'] or '-'} | {fmt(r['bytes_ratio'], '.1f')} | "
        f"{fmt(r['sent_ratio'], '.1f')} | {fmt(r['loss_ratio'], '.3f')} | "
        f"{fmt(r['held_out_ratio'], '.3f')} |")
  return "\n".join(lines)


def plot(outs: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, axes = plt.subplots(len(outs), 2, figsize=(13, 4.2 * len(outs)), squeeze=False)
  for (name, out), (a, b) in zip(outs.items(), axes):
    for method, r in out["results"].items():
      w = max(1, len(r["losses"]) // 30)
      smooth = np.convolve(r["losses"], np.ones(w) / w, mode="valid")
      sent = np.asarray(r["contributed"][w - 1:], np.float64)
      a.plot(sent[sent > 0] / 1e6, smooth[sent > 0], label=method)   # from the first exchange
      b.plot(np.arange(w, len(r["losses"]) + 1), smooth, label=method)
    a.set_xscale("log")
    a.set_xlabel("cumulative MB put into collectives per worker")
    b.set_xlabel("step")
    for ax in (a, b):
      ax.set_ylabel(f"{name}: training loss")
      ax.set_yscale("log")
      ax.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
  fig.suptitle("DeMo, SparseLoCo and MuLoCo against their dense baselines")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", max(args.workers, 1))
  began = time.perf_counter()
  outs = {name: run(name, args) for name in args.problems}
  text = "\n\n".join(table(name, out, args) for name, out in outs.items())
  print(text)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "lowcomm.json").write_text(json.dumps(
      {"config": vars(args), "problems": outs, "seconds": time.perf_counter() - began}))
  (out / "lowcomm.md").write_text(text + "\n")
  plot(outs, out / "lowcomm.png")
  print(f"wrote {out / 'lowcomm.json'}, {out / 'lowcomm.md'} and {out / 'lowcomm.png'} in "
        f"{time.perf_counter() - began:.0f} s")
  return outs


if __name__ == "__main__":
  main()
