"""Train a small character-level transformer whose parameters are sharded, with compressed
data parallelism over replicas (HSDP).

The model is a decoder-only language model in Flax nnx (token and position
embeddings, two pre-norm blocks of causal self-attention and a GELU MLP, a
final projection to the characters): 116k parameters at width 64. Each
parameter is annotated once with *logical* axis names through
``nnx.with_partitioning`` (``embed``, ``mlp``, ``heads``, ...), and
:data:`RULES` maps them to the mesh: ``embed -> "fsdp"``, ``mlp`` and
``heads -> "tensor"``. Creating the model under ``jax.set_mesh(mesh)`` and
``flax.linen.logical_axis_rules(RULES)`` places every parameter sharded as
annotated, so nothing is specified twice.

The mesh is ``(replica=2, fsdp=2, tensor=2)`` over 8 simulated CPU devices.
:func:`commopt.nnx_data_parallel` with ``axis_name="replica"`` runs two
data-parallel workers (replicas), each an FSDP x tensor-parallel group of 4
devices; the optimizer runs on each device's shard of every parameter, so a
compressor encodes that shard, and error-feedback residuals, DiLoCo's anchor
and outer state stay sharded like the parameters (with the worker axis in
front where they are per worker). Only the optimizer's exchange crosses the
replica axis; the compiler's FSDP gathers and tensor-parallel reductions stay
inside each replica.

Methods (``--method``, comma-separated, default all four):

- ``unsharded``: the reference: parameters replicated on a 2-device mesh
  ``(replica=2,)``, a dense mean of the gradients, then AdamW.
- ``dense``: the same on the HSDP mesh (``compressed_mean`` with the identity
  compressor, then AdamW): equal to ``unsharded`` up to float rounding.
- ``diloco``: DiLoCo with AdamW inside (``local_params=True``, each replica
  keeps its own parameters), synchronising every ``--period`` steps with the
  pseudo-gradients quantised to ``--bits``-bit integers
  (``commopt.int_quant``, stochastic rounding) and an outer Nesterov SGD
  (rate 0.7, momentum 0.5).
- ``scaled_sign``: every step, ``compressed_mean(commopt.scaled_sign())``
  with error feedback (one sign bit per coordinate and a scale), then AdamW.

Every run starts from the same model and sees the same batches. The script
prints the training loss (the workers' mean) every ``--log-every`` steps, the
held-out loss of the global model at the end (DiLoCo's anchor), and the bytes
each device puts on the replica axis per step, read from the compiled step's
HLO (:func:`commopt.wire.hlo_collectives`): the collectives whose groups
span the replica axis only. DiLoCo's exchange sits in a ``cond`` that runs
every ``--period`` steps; its bytes per step are the exchange's divided by the
period. Inside a replica each device computes on its part of the worker's
rows (``batch -> "fsdp"``), as FSDP does.

The text is Python's own, offline: the Zen of Python (the ``this`` module)
and the docstrings of a fixed list of standard-library modules, read at the
character level (the corpus, so the vocabulary, depends on the Python
version a little).

    python examples/sharded_lm.py                          # the four runs, about a minute
    python examples/sharded_lm.py --method diloco --period 16 --bits 8
    python examples/sharded_lm.py --steps 1200 --plot sharded_lm.png --json sharded_lm.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import commopt

METHODS = ("unsharded", "dense", "diloco", "scaled_sign")

AXES = ("replica", "fsdp", "tensor")
"""The HSDP mesh's axes: workers, then the two model axes inside each worker."""

RULES = (("batch", "fsdp"), ("vocab", None), ("seq", None), ("embed", "fsdp"), ("mlp", "tensor"),
         ("heads", "tensor"), ("kv", None), ("qkv", None))
"""Logical axis names (the model's annotations) -> mesh axes of the HSDP mesh."""

REPLICATED = tuple((name, None) for name, _ in RULES)
"""The same names mapped to no mesh axis: the unsharded reference."""

MODULES = ("argparse", "ast", "asyncio", "base64", "bisect", "calendar", "codecs",
           "collections", "configparser", "contextlib", "copy", "csv", "dataclasses",
           "datetime", "decimal", "difflib", "doctest", "email", "enum", "fractions",
           "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect", "io",
           "ipaddress", "itertools", "json", "logging", "math", "operator", "optparse", "os",
           "pathlib", "pickle", "pprint", "queue", "random", "re", "shlex", "shutil", "socket",
           "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
           "textwrap", "threading", "time", "traceback", "types", "typing", "unittest",
           "urllib.parse", "uuid", "warnings", "weakref", "zipfile")
"""The standard-library modules whose docstrings (with the Zen of Python) make the corpus."""


# -- data ------------------------------------------------------------------------------

def docstrings() -> list[str]:
  """The Zen of Python, then the docstrings of :data:`MODULES`, their public functions and
  classes and the classes' public methods, each once, in a fixed order: about 500k
  characters, printable ASCII (other characters become ``?``)."""
  with contextlib.redirect_stdout(io.StringIO()):      # importing `this` prints the Zen
    import this
  docs, seen = ["".join(this.d.get(c, c) for c in this.s)], set()
  with warnings.catch_warnings():                      # deprecated aliases warn when read
    warnings.simplefilter("ignore")
    for name in MODULES:
      try:
        module = importlib.import_module(name)
      except ImportError:                              # a Python built without it
        continue
      for doc in _documented(module):
        if doc not in seen:
          seen.add(doc)
          docs.append(doc)
  clean = lambda d: "".join(c if c == "\n" or " " <= c <= "~" else "?" for c in d)
  return [clean(d) for d in docs]


def _documented(module):
  """The docstrings of ``module``, of its public functions and classes defined there, and of
  those classes' public methods, in name order."""
  import inspect
  for obj in [module] + [getattr(module, a) for a in sorted(dir(module)) if a[0] != "_"]:
    members = [obj]
    if inspect.isclass(obj):
      members += [getattr(obj, a, None) for a in sorted(vars(obj)) if a[0] != "_"]
    for x in members:
      if not (inspect.ismodule(x) or inspect.isclass(x) or inspect.isroutine(x)):
        continue
      if x is not module and getattr(x, "__module__", module.__name__) != module.__name__:
        continue                                       # documented where it is defined
      doc = inspect.getdoc(x)
      if doc:
        yield doc


def encode(docs: list[str], holdout: int = 10):
  """``(train_ids, test_ids, chars)``: every ``holdout``-th docstring held out, the rest for
  training, each joined by blank lines into int32 indices of the sorted characters."""
  chars = sorted(set("".join(docs)))
  index = {c: i for i, c in enumerate(chars)}
  ids = lambda part: np.asarray([index[c] for c in "\n\n".join(part)], np.int32)
  test = [d for i, d in enumerate(docs) if i % holdout == holdout - 1]
  train = [d for i, d in enumerate(docs) if i % holdout != holdout - 1]
  return ids(train), ids(test), chars


def windows(ids: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
  """The batch of windows of ``ids`` at ``starts``: inputs ``x`` and next characters ``y``."""
  rows = ids[starts[:, None] + np.arange(seq_len + 1)]
  return {"x": rows[:, :-1], "y": rows[:, 1:]}


# -- model -----------------------------------------------------------------------------

def spec(rules, *names) -> P:
  """The ``PartitionSpec`` of an array whose dimensions have logical ``names`` (None: not
  sharded) under ``rules``, e.g. ``spec(RULES, None, "mlp") == P(None, "tensor")``."""
  table = dict(rules)
  return P(*(None if n is None else table.get(n) for n in names))


def spec_tuple(x) -> tuple:
  """A placed array's PartitionSpec as a tuple, trailing Nones dropped (replicated: ``()``)."""
  spec = tuple(x.sharding.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


def normal(fan_in: int):
  """``N(0, 1/fan_in)``: an initializer keeping activations' scale through a projection."""
  return nnx.initializers.normal(fan_in ** -0.5)


class Sharded(nnx.Module):
  """A module that keeps the logical axis rules its parameters were placed by.

  JAX's explicit sharding wants every contraction over a sharded dimension to
  name its output's sharding; :meth:`spec` turns an activation's logical
  names into it through the same rules.
  """
  rules: tuple

  def spec(self, *names) -> P:
    """The ``PartitionSpec`` of an activation with logical ``names`` (:func:`spec`)."""
    return spec(self.rules, *names)


class Block(Sharded):
  """A pre-norm transformer block: causal multi-head self-attention, then a GELU MLP.

  Parameters: the heads and the MLP's hidden units are sharded over
  ``tensor`` (``heads``, ``mlp``), the model width over ``fsdp`` (``embed``).
  Activations: the batch over ``fsdp`` (``batch``: each device of a worker
  computes on its part of the worker's rows, as in FSDP), the heads and the
  hidden units over ``tensor`` like their parameters, the width whole.
  """

  def __init__(self, width: int, heads: int, hidden: int, rules, rngs: nnx.Rngs):
    part = nnx.with_partitioning
    head = width // heads
    self.rules = rules
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.qkv = nnx.LinearGeneral(
        width, (3, heads, head), use_bias=False, rngs=rngs,
        kernel_init=part(normal(width), ("embed", "qkv", "heads", "kv")))
    self.proj = nnx.LinearGeneral(
        (heads, head), width, axis=(-2, -1), rngs=rngs,
        kernel_init=part(normal(width), ("heads", "kv", "embed")))
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, hidden, rngs=rngs,
                         kernel_init=part(normal(width), ("embed", "mlp")),
                         bias_init=part(nnx.initializers.zeros, ("mlp",)))
    self.down = nnx.Linear(hidden, width, rngs=rngs,
                           kernel_init=part(normal(hidden), ("mlp", "embed")))

  def __call__(self, x):
    steps = x.shape[1]
    qkv = self.qkv(self.norm1(x), out_sharding=self.spec("batch", None, None, "heads", None))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]           # [batch, seq, heads, head]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((steps, steps), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    x = x + self.proj(attended, out_sharding=self.spec("batch", None, None))
    hidden = jax.nn.gelu(self.up(self.norm2(x), out_sharding=self.spec("batch", None, "mlp")))
    return x + self.down(hidden, out_sharding=self.spec("batch", None, None))


class CharLM(Sharded):
  """A decoder-only character model: embeddings, ``layers`` blocks, a final projection."""

  def __init__(self, vocab: int, seq_len: int, *, width: int = 64, heads: int = 4,
               layers: int = 2, rules=RULES, rngs: nnx.Rngs):
    part = nnx.with_partitioning
    self.embed = nnx.Embed(vocab, width, rngs=rngs,
                           embedding_init=part(nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.pos = nnx.Param(part(nnx.initializers.normal(0.1), ("seq", "embed"))(
        rngs.params(), (seq_len, width)))
    self.rules = rules
    self.blocks = nnx.List([Block(width, heads, 4 * width, rules, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs,
                           kernel_init=part(normal(width), ("embed", "vocab")))

  def __call__(self, tokens):
    # The table gathered whole (as FSDP does before using a layer), then the lookup by
    # hand: ``nnx.Embed.__call__(out_sharding=...)`` goes through ``auto_axes``, which
    # JAX refuses inside a shard_map (the unsharded run's step).
    table = jax.sharding.reshard(self.embed.embedding[...], P())
    x = table.at[tokens].get(out_sharding=self.spec("batch", None, None))
    x = x + jax.sharding.reshard(self.pos[...][:tokens.shape[1]], P())
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x), out_sharding=self.spec("batch", None, "vocab"))


def cross_entropy(model, batch):
  """The mean next-character cross-entropy: ``loss_fn(model, batch)``."""
  logits = model(batch["x"])
  labels = jax.sharding.reshard(batch["y"], model.spec("batch", None))   # as the logits
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def build_model(mesh, rules, vocab: int, args) -> CharLM:
  """The model, its parameters placed on ``mesh`` as its annotations map through ``rules``."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    return CharLM(vocab, args.seq_len, width=args.width, heads=args.heads,
                  layers=args.layers, rules=rules, rngs=nnx.Rngs(args.seed))


# -- optimizers ------------------------------------------------------------------------

def optimizer(method: str, args) -> optax.GradientTransformation:
  """The transformation of ``method``, reducing over ``"replica"``."""
  warmup = min(args.warmup, args.steps // 2)
  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
  adamw = optax.adamw(lr, weight_decay=args.weight_decay)
  if method in ("unsharded", "dense"):
    reduce = commopt.compressed_mean(commopt.compressors.identity(), axis_name="replica")
    return optax.chain(reduce, adamw)
  if method == "scaled_sign":
    reduce = commopt.compressed_mean(commopt.scaled_sign(), axis_name="replica")
    return optax.chain(reduce, adamw)
  if method == "diloco":
    outer = optax.sgd(args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    return commopt.diloco(adamw, outer, axis_name="replica", period=args.period,
                          compressor=commopt.int_quant(bits=args.bits), min_size=args.min_size)
  raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


# -- wire audit ------------------------------------------------------------------------

def axes_spanned(mesh, groups) -> set:
  """The mesh axes along which the devices of a collective's groups differ (the groups as
  device positions in the mesh, as the compiled program numbers them)."""
  coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.devices.shape), axis=1)
  spanned = set()
  for group in groups:
    varies = np.ptp(coords[list(group)], axis=0) > 0
    spanned |= {name for name, v in zip(mesh.axis_names, varies) if v}
  return spanned


def audit(trainer, state, batch, mesh) -> dict:
  """The compiled step's collectives, by the mesh axes they run over.

  Returns:
    ``{"replica": (count, bytes), "model": (count, bytes), "other": (count, bytes)}``:
    the collectives and the bytes each device puts into them, over the replica
    axis only (between workers), over the model axes only (inside a worker:
    the compiler's FSDP gathers and tensor-parallel reductions), and over both
    (the 4-byte flag by which all devices agree to skip a non-finite step).
  """
  out = {"replica": [0, 0], "model": [0, 0], "other": [0, 0]}
  for c in commopt.wire.hlo_collectives(trainer, state, batch):
    spanned = axes_spanned(mesh, c.replica_groups)
    kind = ("model" if "replica" not in spanned else "replica" if spanned == {"replica"}
            else "other")
    out[kind][0] += 1
    out[kind][1] += c.contributed_bytes
  return {k: tuple(v) for k, v in out.items()}


# -- training --------------------------------------------------------------------------

def train(method: str, args, data, mesh, model, say=print) -> dict:
  """Trains ``method`` from ``model`` (left as it is) on ``mesh``; returns its history and
  measurements."""
  train_ids, test_ids, _ = data
  local = method == "diloco"
  began = time.perf_counter()
  trainer = commopt.nnx_data_parallel(model, cross_entropy, optimizer(method, args), mesh,
                                      axis_name="replica", local_params=local)
  state = trainer.init(model)
  params = trainer.split(model)[0]
  layout = trainer.dp.layout(params)
  specs = {"/".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path
                    if not isinstance(k, jax.tree_util.GetAttrKey)): spec_tuple(v)
           for path, v in jax.tree_util.tree_leaves_with_path(params)}

  def draw(rng):
    """A global batch of random windows of the training text."""
    starts = rng.integers(0, len(train_ids) - args.seq_len - 1, args.batch_size)
    return windows(train_ids, starts, args.seq_len)

  # DiLoCo's exchange is in a cond that runs every `period` steps (no other step sends
  # anything over the replica axis): its bytes per step are the exchange's over the period.
  wire = audit(trainer, state, draw(np.random.default_rng(args.seed)), mesh)
  per_step = wire["replica"][1] / (args.period if local else 1)
  say(f"\n== {method}: shard_local={layout.shard_local}; over the replica axis each device "
      f"puts {wire['replica'][1] / 1e3:,.1f} kB in {wire['replica'][0]} collectives per "
      + (f"exchange (every {args.period} steps: {per_step / 1e3:,.2f} kB per step)" if local
         else "step")
      + f"; inside a replica (fsdp, tensor) {wire['model'][1] / 1e3:,.1f} kB in "
      f"{wire['model'][0]} collectives"
      + (f"; over all devices {wire['other'][1]} B in {wire['other'][0]}" if wire["other"][0]
         else ""))

  # The held-out windows, and the loss of the global model on them.
  starts = np.linspace(0, len(test_ids) - args.seq_len - 1, args.eval_windows).astype(int)
  test = {k: jnp.asarray(v) for k, v in windows(test_ids, starts, args.seq_len).items()}
  graphdef = nnx.graphdef(model)

  @jax.jit
  def held_out(params, model_state):
    return cross_entropy(nnx.merge(graphdef, params, model_state), test)

  history = {"method": method, "loss": []}      # the workers' mean loss at every step
  rng = np.random.default_rng(args.seed)          # every method sees the same batches
  for step in range(1, args.steps + 1):
    if step == 2:
      first = time.perf_counter()                 # after the first step, which compiled
    state, losses = trainer.step(state, draw(rng))
    history["loss"].append(float(jnp.mean(losses)))
    if step % args.log_every == 0 or step == args.steps:
      recent = history["loss"][-args.log_every:]
      say(f"{method:>12} step {step:5d}  loss {np.mean(recent):.4f} (mean of the last "
          f"{len(recent)} steps)")
  trained = time.perf_counter()
  final = state.params
  if local:
    final = jax.tree.map(lambda g, p: g.astype(p.dtype),
                         commopt.transforms.global_params(state.opt_state), params)
  with jax.set_mesh(mesh):
    test_loss = float(held_out(final, state.model_state))
  seconds = time.perf_counter() - began
  per_step_s = (trained - first) / (args.steps - 1) if args.steps > 1 else seconds
  tail = history["loss"][-max(1, args.steps // 10):]
  say(f"{method:>12} held-out loss {test_loss:.4f} ({seconds:.1f} s in all, "
      f"{1e3 * per_step_s:.0f} ms per step)")
  return dict(history, test_loss=test_loss, final_loss=float(np.mean(tail)), seconds=seconds,
              step_ms=1e3 * per_step_s,
              shard_local=bool(layout.shard_local), param_specs=specs,
              replica_bytes_per_step=per_step, replica_bytes_per_exchange=wire["replica"][1],
              replica_collectives=wire["replica"][0], model_axis_bytes=wire["model"][1],
              model_axis_collectives=wire["model"][0], other_bytes=wire["other"][1],
              num_params=int(sum(x.size for x in jax.tree.leaves(params))))


def plot_losses(results: dict, steps: int, path: str, title: str, label, reference: str) -> None:
  """Each run's training loss (moving means over a sixtieth of the run) to ``path``;
  ``label(method, history)`` names a curve, ``reference`` is drawn dashed on top."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  width = max(1, steps // 60)
  for m, h in results.items():
    smooth = np.convolve(h["loss"], np.ones(width) / width, mode="valid")
    ax.plot(np.arange(width, len(h["loss"]) + 1), smooth, label=label(m, h),
            ls="--" if m == reference else "-", zorder=3 if m == reference else 2)
  ax.set_xlabel("step")
  ax.set_ylabel(f"training loss (nats/char, mean of {width} steps)")
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def plot(results: dict, args) -> None:
  """The training losses to ``args.plot``."""
  plot_losses(results, args.steps, args.plot,
              "character LM, HSDP mesh (replica=2, fsdp=2, tensor=2)",
              lambda m, h: f"{m} ({h['replica_bytes_per_step'] / 1e3:,.1f} kB/step per device)",
              "unsharded")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--method", default=",".join(METHODS),
                 help=f"comma-separated methods among {', '.join(METHODS)}")
  p.add_argument("--steps", type=int, default=120)
  p.add_argument("--batch-size", type=int, default=32, help="global batch, split over replicas")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--lr", type=float, default=1e-2, help="AdamW's peak learning rate")
  p.add_argument("--warmup", type=int, default=10,
                 help="steps of linear warm-up, then a cosine decay to lr/10 at --steps")
  p.add_argument("--weight-decay", type=float, default=1e-4)
  p.add_argument("--period", type=int, default=8, help="diloco: steps between exchanges")
  p.add_argument("--bits", type=int, default=4, help="diloco: int_quant bits (4 or 8)")
  p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer Nesterov SGD's rate")
  p.add_argument("--outer-momentum", type=float, default=0.5,
                 help="diloco: outer momentum (DiLoCo's 0.9 stayed on the loss plateau "
                      "longer here: see docs/guide/sharded_lm.md)")
  p.add_argument("--min-size", type=int, default=1024,
                 help="diloco: leaves with fewer elements (on this mesh: each device's shard "
                      "of a leaf) are exchanged dense")
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--eval-windows", type=int, default=256,
                 help="held-out windows the final loss is measured on")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
  p.add_argument("--json", default=None, help="write the histories and measurements here")
  args = p.parse_args(argv)
  args.methods = [m.strip() for m in args.method.split(",") if m.strip()]
  unknown = [m for m in args.methods if m not in METHODS]
  if unknown or not args.methods:
    p.error(f"--method: unknown {unknown}; choose from {', '.join(METHODS)}")
  if args.batch_size % 4:
    p.error("--batch-size must be a multiple of 4 (2 replicas, each splitting its rows over "
            "fsdp=2)")
  return args


def main(argv=None) -> dict:
  """Runs the methods asked for; returns ``{method: history}``."""
  args = parse_args(argv)
  if len(jax.devices()) < 8:
    sys.exit(f"needs 8 devices; this backend has {len(jax.devices())} "
             f"(on CPU: jax.config.update('jax_num_cpu_devices', 8) before JAX starts)")
  meshes = {"hsdp": jax.make_mesh((2, 2, 2), AXES, devices=jax.devices()[:8]),
            "unsharded": jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])}
  data = encode(docstrings())
  train_ids, test_ids, chars = data
  print(f"{len(train_ids):,} training characters, {len(test_ids):,} held out, "
        f"{len(chars)} distinct; mesh {dict(meshes['hsdp'].shape)}, 2 replicas, "
        f"global batch {args.batch_size} x {args.seq_len} characters, {args.steps} steps")
  models = {}                        # one per mesh: every run starts from the same values

  def start(method):
    kind = "unsharded" if method == "unsharded" else "hsdp"
    if kind not in models:
      models[kind] = build_model(meshes[kind], REPLICATED if kind == "unsharded" else RULES,
                                 len(chars), args)
    return meshes[kind], models[kind]

  results = {m: train(m, args, data, *start(m)) for m in args.methods}
  first = results[args.methods[0]]
  print(f"\n{first['num_params']:,} parameters; final loss: the training loss's mean over the "
        f"last {max(1, args.steps // 10)} steps; held-out: the global model's loss on "
        f"{args.eval_windows} held-out windows")
  print(f"{'method':<12} {'final loss':>10} {'held-out':>9} {'replica kB/step':>16} "
        f"{'ms/step':>8} {'seconds':>8}")
  for m, h in results.items():
    print(f"{m:<12} {h['final_loss']:10.4f} {h['test_loss']:9.4f} "
          f"{h['replica_bytes_per_step'] / 1e3:16.2f} {h['step_ms']:8.0f} {h['seconds']:8.1f}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(dict(args=vars(args), runs=results), indent=1))
    print(f"wrote {args.json}")
  if args.plot:
    plot(results, args)
  return results


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main()
