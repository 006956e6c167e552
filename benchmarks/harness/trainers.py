"""commopt's methods as the network benchmark (``bench_network.py``) trains and times them.

The catalogue (:data:`METHODS`, :data:`COMBINED`, :data:`EAGER`, :data:`OVERLAPPED`,
:data:`ZERO`, :data:`TORCH_METHODS`), each label's optax transform (:func:`make_tx`), the
ZeRO-3 and eager DiLoCo runs behind the calls a data-parallel run answers
(:class:`ZeroTrainer`, :class:`EagerTrainer`), and :class:`Job`: one process's share of a
job, which trains a method, times its steps, times its compute alone and scores the global
model.
"""

from __future__ import annotations

import time
import types

from harness import data, models
from harness.timing import per_step

METHODS = {
    # label: (registry name, options, strategy, error feedback)
    "dense": ("identity", {}, "auto", False),
    "cast(bf16)": ("cast", {"dtype": "bfloat16"}, "auto", True),
    # DDP's fp16 hook as commopt runs it: float16 chunks (moved as 16-bit words) to their
    # owners, summed there in float32, the float16 means gathered back; no residual, as the hook.
    "cast(fp16)/two_phase": ("cast", {"dtype": "float16"}, "two_phase", False),
    "scaled_sign/gather": ("scaled_sign", {}, "gather", True),
    "scaled_sign/two_phase": ("scaled_sign", {}, "two_phase", True),
    "top_k(0.01)/gather": ("top_k", {"ratio": 0.01}, "gather", True),
    "top_k(0.01)/two_phase": ("top_k", {"ratio": 0.01}, "two_phase", True),
    # Unbiased, and with 7 levels per 512-value bucket its variance bound is
    # ~3.2x the input's: error feedback is not a contraction for it and
    # diverges, so QSGD runs as published, without it.
    "qsgd/gather": ("qsgd", {}, "gather", False),
    "qsgd/two_phase": ("qsgd", {}, "two_phase", False),
    "power_sgd(2)": ("power_sgd", {"rank": 2}, "auto", True),
}
"""commopt's per-step methods: every step all-reduces through the compressor."""
COMBINED = {
    # label: (period H, registry name, options, strategy, outer optimizer)
    # DiLoCo with the same momentum SGD inside, its pseudo-gradients exchanged every H steps
    # through a compressor. Outer: sgd(1.0) throughout, the module's choice over an
    # error-feedback residual (scaled_sign), passed for int_quant, which keeps none (its default
    # there, Nesterov 0.7/0.9, compounds with the inner momentum and diverges on this MLP).
    "diloco(3)+int_quant(4)": (3, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(4)+int_quant(4)": (4, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(8)+int_quant(4)": (8, "int_quant", {"bits": 4}, "two_phase", "sgd(1.0)"),
    "diloco(8)+scaled_sign": (8, "scaled_sign", {}, "two_phase", None),
}
"""commopt's combined methods: DiLoCo (``period`` local steps) with compressed outer gradients."""
ZERO = {
    # label: (weights, grads): zero_data_parallel's gathers, int_quant nearest, blocks of 2048
    "zero": (None, None),
    "zero+qwZ": (8, None),
    "zero+qgZ": (None, 4),
    "zero+qwZ+qgZ": (8, 4),
}
"""commopt's ZeRO-3 (parameters and state sharded over the workers): dense, int8 weights
(qwZ), int4 gradients (qgZ), both; the same momentum SGD."""
OVERLAPPED = {
    # label: the per-step method whose exchange overlaps the next backward pass
    "overlap:dense": "dense",
    "overlap:scaled_sign/gather": "scaled_sign/gather",
}
"""commopt's per-step methods one step delayed, run by ``overlapped_data_parallel``: the
exchange of the kept gradient on a thread of its own beside the next backward pass."""
EAGER = {
    # label: (the combined method (COMBINED) whose outer steps are eager, own_weight)
    "eager:diloco(4)+int_quant(4)": ("diloco(4)+int_quant(4)", None),
    "eager:diloco(8)+int_quant(4)": ("diloco(8)+int_quant(4)", None),
    "eager(w=1):diloco(3)+int_quant(4)": ("diloco(3)+int_quant(4)", 1.0),
    "eager(w=1):diloco(4)+int_quant(4)": ("diloco(4)+int_quant(4)", 1.0),
    "eager(w=1):diloco(8)+int_quant(4)": ("diloco(8)+int_quant(4)", 1.0),
}
"""commopt's combined methods with eager outer steps (``eager_diloco``): each outer exchange on
a thread of its own beside the whole next inner phase, the outer step taken at once; the
worker's own pseudo-gradient weighs 1/M in its estimate (the paper's), or 1 (``w=1``)."""
TORCH_METHODS = ("torch:dense", "torch:fp16", "torch:power_sgd(2)")
"""The PyTorch peer (:mod:`harness.torch_peer`): DDP over gloo, plain and with its hooks."""
ALL_METHODS = [*METHODS, *COMBINED, *EAGER, *OVERLAPPED, *ZERO, *TORCH_METHODS]


def order(label: str) -> int:
  """A method's place in tables and plots (labels this version does not know last)."""
  return ALL_METHODS.index(label) if label in ALL_METHODS else len(ALL_METHODS)


def combined_options(label: str, lr: float) -> dict:
  """The arguments of a combined method's DiLoCo (``COMBINED``): inner and outer optimizers,
  period, strategy and compressor, as ``diloco`` and ``eager_diloco`` take them."""
  import optax

  import commopt
  period, name, opts, strategy, outer = COMBINED[label]
  return dict(inner=optax.sgd(lr, momentum=0.9),
              outer={None: None, "sgd(1.0)": optax.sgd(1.0)}[outer], period=period,
              strategy=strategy, compressor=commopt.compressors.make(name, **opts))


def make_tx(label: str, lr: float):
  """(optax transform, period, whether each worker keeps its own parameters) of a commopt method."""
  import optax

  import commopt
  inner = optax.sgd(lr, momentum=0.9)
  if label in COMBINED:
    options = combined_options(label, lr)
    return commopt.diloco(axis_name="data", **options), options["period"], True
  name, opts, strategy, ef = METHODS[label]
  reducer = commopt.compressed_mean(commopt.compressors.make(name, **opts), axis_name="data",
                                    strategy=strategy, error_feedback=ef)
  return optax.chain(reducer, inner), 1, False


class ZeroTrainer:
  """A ``zero_data_parallel`` run behind the few calls the worker makes of ``data_parallel``
  (``place_params``, ``init``, ``local_batch``, ``step``), and ``whole`` for its model."""

  def __init__(self, label: str, loss_fn, lr: float, mesh):
    import optax

    import commopt
    quant = lambda bits: None if bits is None else models.quantizer(bits)
    weights, grads = ZERO[label]
    self.zp = commopt.zero_data_parallel(loss_fn, optax.sgd(lr, momentum=0.9), mesh,
                                         weights=quant(weights), grads=quant(grads))

  def place_params(self, params):
    return self.zp.shard(params)

  def init(self, params):
    return self.zp.init(self.zp.shard(params))

  def local_batch(self, rows):
    return self.zp.local_batch(rows)

  def step(self, params, state, batch):
    return self.zp.step(params, state, batch)

  def whole(self, params):
    return self.zp.unshard(params)

  def sent_bytes(self, params, state, batch) -> int:
    """What one worker sends per step (ring model), from the compiled step."""
    from commopt import wire
    text = self.zp.lower(params, state, batch).compile().as_text()
    return wire.total_bytes(wire.parse_hlo(text), "sent_bytes", per_run=True)


class EagerTrainer:
  """An ``eager_diloco`` run behind the calls the worker makes of ``data_parallel``, and what
  scoring its global model needs while an exchange may be in flight (no collective then)."""

  def __init__(self, label: str, loss_fn, lr: float, mesh):
    import commopt
    combined, own_weight = EAGER[label]
    self.run = commopt.parallel.eager_diloco(loss_fn, mesh=mesh, own_weight=own_weight,
                                    **combined_options(combined, lr))
    self.place_params, self.local_batch = self.run.place_params, self.run.local_batch
    self.init, self.step = self.run.init, self.run.step

  @staticmethod
  def ready(params, state):
    """What a step's time waits for: the inner step and the outer step, not the exchange."""
    return params, state.inner, state.anchors

  @staticmethod
  def snapshot(state):
    """This process's workers' anchors, stacked on the host (no collective)."""
    import jax
    import numpy as np
    return jax.tree.map(lambda a: np.concatenate(
        [np.asarray(s.data) for s in a.addressable_shards]), state.anchors)

  def finish(self, params, state):
    params, state = self.run.finish(params, state)
    self.run.close()
    return params, state


class Job:
  """One process's share of a job of the network benchmark: the digits, this process's share
  of every step's batch, the MLP (64 -> H -> H -> 10), the global mesh (one device per
  process) and this process's alone, and the global model's loss on the digits."""

  def __init__(self, ctx, cfg: dict):
    import jax
    digits = data.digits_cnn()
    self.ctx, self.cfg = ctx, cfg
    self.x_all, self.y_all = digits.load_digits_flat()
    self.workers = jax.device_count()
    # Host copies: every run places its own.
    self.params0, self.loss_fn = digits.mlp_fns(cfg["hidden"])
    self.global_mesh = jax.make_mesh((self.workers,), ("data",))
    self.local_mesh = jax.make_mesh((1,), ("data",), devices=jax.local_devices()[:1])
    self.score = jax.jit(self.loss_fn)
    self.scored = data.eval_rows(len(self.x_all))
    self.barriers = iter(range(1 << 30))

  def my_rows(self, step):
    """This process's share of step ``step``'s global batch."""
    import numpy as np
    idx = data.batch_rows(len(self.x_all), step, self.cfg["batch"] * self.workers)
    mine = np.split(idx, self.ctx.num_processes)[self.ctx.process_id]
    return {"x": self.x_all[mine], "y": self.y_all[mine]}

  def barrier(self):
    """Every process here, through the coordination service (not a device collective), so
    that the evaluation's gather never starts while a step's collectives run on another
    process."""
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier(f"bench_network_{next(self.barriers)}",
                                                    600_000)

  def global_loss(self, model, rows=None) -> float:
    """The loss of a (replicated) global model, or of host arrays the same on every process,
    on ``rows`` of the digits (all by default): each process scores its share, and the
    processes add up (untimed)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    x_all, y_all, ctx = self.x_all, self.y_all, self.ctx
    rows = np.arange(len(x_all)) if rows is None else rows
    share = np.array_split(rows, ctx.num_processes)[ctx.process_id]
    host = jax.tree.map(lambda a: a if isinstance(a, np.ndarray)
                        else np.asarray(a.addressable_data(0)), model)
    part = float(self.score(host, {"x": x_all[share], "y": y_all[share]})) * len(share)
    self.barrier()
    total = float(np.sum(multihost_utils.process_allgather(np.float64(part)))) / len(rows)
    self.barrier()
    return total

  def measure(self, label: str) -> dict:
    """Method ``label`` trained for ``cfg["steps"]`` steps, every step timed and the global
    model scored after it (untimed), then its compute alone: the result's row."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import commopt
    from commopt import wire
    cfg, ctx, workers, loss_fn, params0 = (self.cfg, self.ctx, self.workers, self.loss_fn,
                                           self.params0)
    global_mesh, local_mesh, my_rows = self.global_mesh, self.local_mesh, self.my_rows
    global_loss, scored = self.global_loss, self.scored
    zero, eager = label in ZERO, label in EAGER
    overlapped = label in OVERLAPPED
    if zero:
      dp, period, local_params = ZeroTrainer(label, loss_fn, cfg["lr"], global_mesh), 1, False
      whole = dp.whole
    elif eager:
      tx, period, local_params = make_tx(EAGER[label][0], cfg["lr"])
      dp = EagerTrainer(label, loss_fn, cfg["lr"], global_mesh)
    elif overlapped:
      tx, period, local_params = make_tx(OVERLAPPED[label], cfg["lr"])
      dp = commopt.parallel.overlapped_data_parallel(loss_fn, tx, global_mesh)
      whole = lambda p: p
    else:
      tx, period, local_params = make_tx(label, cfg["lr"])
      dp = commopt.data_parallel(loss_fn, tx, global_mesh, local_params=local_params)
      whole = lambda p: p
    params, state = dp.place_params(params0), dp.init(params0)
    # What one synchronisation sends; a periodic method's per-step share is 1/period of it.
    if zero:
      dense = wire.comm_plan(make_tx("dense", cfg["lr"])[0], params0, workers)
      sent = dp.sent_bytes(params, state, dp.local_batch(my_rows(0)))
      plan = types.SimpleNamespace(sent_bytes=sent, dense_sent=dense.dense_sent)
    else:
      plan = wire.comm_plan(tx, params0, workers)
    times, losses, global_losses, anchors = [], [], [], []
    for step in range(cfg["steps"]):
      batch = dp.local_batch(my_rows(step))
      t0 = time.perf_counter()
      params, state, loss = dp.step(params, state, batch)
      jax.block_until_ready((params, state.opt, state.kept) if overlapped else
                            dp.ready(params, state) if eager else (params, state))
      times.append(time.perf_counter() - t0)
      losses.append(loss)
      # The global model after this step, scored untimed: the parameters, or a periodic
      # method's anchor, which only a synchronisation moves. An eager run's exchange may be
      # in flight: its anchors are kept on the host and scored once it has finished.
      if not local_params:
        global_losses.append([step + 1, global_loss(whole(params), scored)])
      elif commopt.transforms.is_sync_step(step, period, 0):
        if eager:
          anchors.append([step + 1, dp.snapshot(state)])
        else:
          global_losses.append([step + 1,
                                global_loss(commopt.transforms.global_params(state), scored)])
    if eager:
      params, state = dp.finish(params, state)
      for k, mine in anchors:     # the mean of every worker's anchor, over the processes
        every = multihost_utils.process_allgather(mine)
        model = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]).mean(axis=0), every)
        global_losses.append([k, global_loss(model, scored)])
    losses = [float(np.mean(v)) for v in multihost_utils.process_allgather(losses, tiled=True)]
    model = dp.run.global_params(state) if eager else (
        commopt.transforms.global_params(state) if local_params else whole(params))
    eval_loss = global_loss(model)
    # Compute alone: the same step on this process's device, every process at once (whole
    # periods of a periodic method, each with its one exchange, encoding and decoding).
    local = (ZeroTrainer(label, loss_fn, cfg["lr"], local_mesh) if zero else
             EagerTrainer(label, loss_fn, cfg["lr"], local_mesh) if eager else
             commopt.data_parallel(loss_fn, tx, local_mesh, local_params=local_params))
    lp, ls = local.place_params(params0), local.init(params0)
    batch = my_rows(0)
    multihost_utils.sync_global_devices(f"compute {label}")
    compute = []
    # Compiling steps: the first (and an overlapped method's second, the exchange's first; an
    # eager method's first two periods: its outer step's, then the wait for its first exchange;
    # a periodic method's first period, whose last step makes its program's first cross-process
    # collective, as the dense step does in its first step: 0.6-1.1 s in two runs of three).
    compiling = 2 if overlapped else 2 * period if eager else period
    warm = compiling if eager else 1     # compute alone: an overlapped step has no exchange
    for _ in range(period * -(-cfg["compute_steps"] // period) + warm):
      t0 = time.perf_counter()
      lp, ls, _ = local.step(lp, ls, batch)
      jax.block_until_ready(local.ready(lp, ls) if eager else (lp, ls))
      compute.append(time.perf_counter() - t0)
    if eager:
      local.finish(lp, ls)
    multihost_utils.sync_global_devices(f"computed {label}")
    if overlapped:
      dp.close()
    step_s = per_step(times[compiling:], period)
    compute_s = per_step(compute[warm:], period)
    comm_s = max(step_s - compute_s, 0.0)
    result = {
        "step_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
        "sent_bytes": plan.sent_bytes / period, "dense_sent_bytes": plan.dense_sent,
        "period": period, "sync_sent_bytes": plan.sent_bytes, "global_losses": global_losses,
        "losses": losses, "step_times": times, "compile_s": times[0], "eval_loss": eval_loss,
        "compiling_steps": compiling,
        # The steps that compile or wait for a compiled program, counted as typical ones.
        "compiled_at": ([0, period - 1, 2 * period - 1] if eager else [0, period - 1]
                        if period > 1 else list(range(compiling))),
    }
    if ctx.is_main:
      print(f"  {label}: {step_s * 1e3:.1f} ms/step (compute {compute_s * 1e3:.1f}, "
            f"communication {comm_s * 1e3:.1f}), {plan.sent_bytes / period / 1e6:.2f} MB "
            f"sent/worker, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return result
