"""Train a small character-level transformer with ZeRO-3: parameters and AdamW's state
sharded over 8 data-parallel devices, gathered one layer at a time, and the ZeRO++-style
quantized collectives (int8 weights, int4 gradients) against dense ones.

The model is a decoder-only language model written as plain functions of a parameter
dict (token and position embeddings, ``--layers`` pre-norm blocks of causal
self-attention and a GELU MLP stacked on a leading layer axis, a final projection to
the characters): 115k parameters at width 64 and 2 layers. The text is the corpus of
``examples/sharded_lm.py`` (the Zen of Python and standard-library docstrings, offline).

Methods (``--method``, comma-separated, default all three), each from the same
parameters, on the same batches, with the same AdamW schedule:

- ``replicated``: ``commopt.data_parallel`` (parameters and AdamW's state on every
  device; an identity ``compressed_mean`` of the gradients).
- ``zero``: ``commopt.zero_data_parallel`` with ``gather="manual"``: the loss gathers
  the embeddings and the head, and a ``lax.scan`` over the stacked blocks gathers one
  block at a time (rematerialised, so the backward pass gathers it again); float32
  all-gathers and reduce-scatters.
- ``zero++``: the same with the weights gathered as ``int_quant(bits=8)`` payloads
  (qwZ) and the gradients reduce-scattered as ``int_quant(bits=4)`` chunks in one
  all-to-all (qgZ), nearest rounding, no error memory.

The script prints the training loss every ``--log-every`` steps, then per method the
final training loss (mean of the last tenth), the held-out loss, the bytes each device
sends per step over the data axis (ring model, from the compiled step's HLO, a scan's
collectives counted once per iteration) and the compiled step's arguments (parameters and
optimizer state) per device.

    python examples/zero_lm.py                              # the three runs, about a minute
    python examples/zero_lm.py --steps 600 --plot zero_lm.png --json zero_lm.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import commopt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sharded_lm import docstrings, encode, plot_losses, windows  # noqa: E402  (the same corpus)

METHODS = ("replicated", "zero", "zero++")
STACKED = {"embed": False, "pos": False, "blocks": True, "norm": False, "head": False}
"""Which parameters are a stack of layers (sharded layer by layer)."""


def init_params(vocab: int, args) -> dict:
  rng = np.random.default_rng(args.seed)
  d, f, n = args.width, 4 * args.width, args.layers
  normal = lambda shape, fan_in: jnp.asarray(rng.normal(size=shape) / np.sqrt(fan_in),
                                             jnp.float32)
  return {"embed": normal((vocab, d), 1.0) * 0.1, "pos": normal((args.seq_len, d), 1.0) * 0.1,
          "blocks": {"norm1": jnp.ones((n, d)), "qkv": normal((n, d, 3 * d), d),
                     "out": normal((n, d, d), d) / np.sqrt(2 * n), "norm2": jnp.ones((n, d)),
                     "up": normal((n, d, f), d), "down": normal((n, f, d), f) / np.sqrt(2 * n)},
          "norm": jnp.ones((d,)), "head": normal((d, vocab), d)}


def rms_norm(h, scale):
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * scale


def block(h, p, heads: int):
  """One pre-norm transformer block on ``h`` ``[B, T, D]``."""
  b, t, d = h.shape
  q, k, v = jnp.split(rms_norm(h, p["norm1"]) @ p["qkv"], 3, axis=-1)
  split = lambda x: x.reshape(b, t, heads, d // heads)
  scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
  scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
  attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), split(v))
  h = h + attn.reshape(b, t, d) @ p["out"]
  return h + jax.nn.gelu(rms_norm(h, p["norm2"]) @ p["up"]) @ p["down"]


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def whole_loss(heads: int):
  """``loss(params, batch)`` on whole parameters (the replicated step, evaluation)."""
  def loss(p, batch):
    h = p["embed"][batch["x"]] + p["pos"]
    h, _ = jax.lax.scan(lambda h, layer: (block(h, layer, heads), None), h, p["blocks"])
    return cross_entropy(rms_norm(h, p["norm"]) @ p["head"], batch["y"])
  return loss


def layered_loss(heads: int):
  """``loss(rows, batch, gather)`` for ``gather="manual"``: one block whole at a time."""
  def loss(rows, batch, gather):
    top = gather({k: rows[k] for k in ("embed", "pos", "norm", "head")})
    h = top["embed"][batch["x"]] + top["pos"]
    body = jax.checkpoint(lambda h, layer: (block(h, gather(layer), heads), None))
    h, _ = jax.lax.scan(body, h, rows["blocks"])
    return cross_entropy(rms_norm(h, top["norm"]) @ top["head"], batch["y"])
  return loss


def adamw(args):
  warmup = min(args.warmup, args.steps // 2)
  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
  return optax.adamw(lr, weight_decay=args.weight_decay)


def trainer(method: str, args, mesh):
  """``(step(state, batch) -> (state, losses), state, whole(state), lowered step)``."""
  if method == "replicated":
    dp = commopt.data_parallel(
        whole_loss(args.heads),
        optax.chain(commopt.compressed_mean(commopt.compressors.identity(), axis_name="data"),
                    adamw(args)), mesh)

    def start(params):
      return dp.place_params(params), dp.init(params)

    def step(state, batch):
      p, s, losses = dp.step(*state, dp.place_batch(batch))
      return (p, s), losses

    lower = lambda state, batch: dp.lower(*state, dp.place_batch(batch))
    return start, step, lambda state: state[0], lower
  quantized = method == "zero++"
  zp = commopt.zero_data_parallel(
      layered_loss(args.heads), adamw(args), mesh, gather="manual",
      weights=commopt.int_quant(bits=8, block_size=2048, rounding="nearest") if quantized else None,
      grads=commopt.int_quant(bits=4, block_size=2048, rounding="nearest") if quantized else None)

  def start(params):
    rows = zp.shard(params, stacked=STACKED)
    return rows, zp.init(rows)

  def step(state, batch):
    rows, s, losses = zp.step(*state, batch)
    return (rows, s), losses

  return start, step, lambda state: zp.unshard(state[0]), lambda state, b: zp.lower(*state, b)


def train(method: str, args, data, mesh, params, say=print) -> dict:
  train_ids, test_ids, _ = data
  start, step, whole, lower = trainer(method, args, mesh)
  state = start(params)
  rng = np.random.default_rng(args.seed)          # every method sees the same batches

  def draw():
    starts = rng.integers(0, len(train_ids) - args.seq_len - 1, args.batch_size)
    return windows(train_ids, starts, args.seq_len)

  # A scan's collectives appear once in the HLO: counted once per iteration (per_run).
  compiled = lower(state, draw()).compile()
  sent = commopt.wire.total_bytes(commopt.wire.parse_hlo(compiled.as_text()), "sent_bytes",
                                  per_run=True)
  memory = compiled.memory_analysis()
  arguments = None if memory is None else memory.argument_size_in_bytes
  history = {"method": method, "loss": []}
  began = time.perf_counter()
  for i in range(1, args.steps + 1):
    state, losses = step(state, draw())
    history["loss"].append(float(jnp.mean(losses)))
    if i % args.log_every == 0 or i == args.steps:
      say(f"{method:>10} step {i:5d}  loss {np.mean(history['loss'][-args.log_every:]):.4f}")
  seconds = time.perf_counter() - began
  starts = np.linspace(0, len(test_ids) - args.seq_len - 1, args.eval_windows).astype(int)
  test = {k: jnp.asarray(v) for k, v in windows(test_ids, starts, args.seq_len).items()}
  final = jax.device_get(whole(state))
  test_loss = float(jax.jit(whole_loss(args.heads))(final, test))
  tail = history["loss"][-max(1, args.steps // 10):]
  return dict(history, final_loss=float(np.mean(tail)), test_loss=test_loss,
              sent_bytes_per_step=int(sent), argument_bytes=arguments,
              seconds=seconds)


def plot(results: dict, args) -> None:
  plot_losses(results, args.steps, args.plot,
              "character LM on 8 devices: replicated, ZeRO-3, ZeRO++-style",
              lambda m, h: f"{m} ({h['sent_bytes_per_step'] / 1e3:,.0f} kB sent/step per device)",
              "replicated")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--method", default=",".join(METHODS), help=f"comma-separated: {METHODS}")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--batch-size", type=int, default=32, help="global batch, split over 8")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--lr", type=float, default=1e-2)
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--weight-decay", type=float, default=1e-4)
  p.add_argument("--log-every", type=int, default=20)
  p.add_argument("--eval-windows", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
  p.add_argument("--json", default=None, help="write the histories and measurements here")
  args = p.parse_args(argv)
  args.methods = [m for m in args.method.split(",") if m]
  bad = [m for m in args.methods if m not in METHODS]
  if bad:
    p.error(f"--method: unknown {bad}; choose from {METHODS}")
  if args.width % args.heads:
    p.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
  if args.batch_size % 8:
    p.error(f"--batch-size must be a multiple of the 8 devices, got {args.batch_size}")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  if len(jax.devices()) < 8:
    sys.exit(f"needs 8 devices; this backend has {len(jax.devices())} "
             f"(on CPU: jax.config.update('jax_num_cpu_devices', 8) before JAX starts)")
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  data = encode(docstrings())
  params = init_params(len(data[2]), args)
  n = sum(x.size for x in jax.tree.leaves(params))
  print(f"{n:,} parameters, {len(data[0]):,} training characters, 8 devices, global batch "
        f"{args.batch_size} x {args.seq_len}, {args.steps} steps")
  results = {m: train(m, args, data, mesh, params) for m in args.methods}
  print(f"\n{'method':<11} {'final loss':>10} {'held-out':>9} {'sent kB/step':>13} "
        f"{'args kB/device':>15} {'seconds':>8}")
  for m, h in results.items():
    args_kb = "-" if h["argument_bytes"] is None else f"{h['argument_bytes'] / 1e3:,.1f}"
    print(f"{m:<11} {h['final_loss']:10.4f} {h['test_loss']:9.4f} "
          f"{h['sent_bytes_per_step'] / 1e3:13.1f} {args_kb:>15} {h['seconds']:8.1f}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(dict(args=vars(args), runs=results), indent=1))
    print(f"wrote {args.json}")
  if args.plot:
    plot(results, args)
  return results


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main()
