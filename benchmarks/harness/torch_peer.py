"""The PyTorch side of ``bench_network.py``: DDP (gloo, CPU) on the benchmark's MLP and batches.

One process of a job that ``python -m commopt.launch`` starts inside the
benchmark's shaped network namespace, as it starts the JAX side; no JAX runs
here (``commopt.launch`` is imported for the process's life-cycle only: it
ends with the launcher, and at once on an uncaught exception). The launcher's
coordinator port, a free one inside the namespace, is torch's rendezvous
(``MASTER_ADDR=127.0.0.1``); gloo uses the namespace's loopback.

The driver hands over, in ``<config>.npz`` (:func:`peer_arrays`), the JAX side's initial MLP
weights and the standardised digits, so both sides train the same model
(``h @ w + b``, ReLU, softmax cross-entropy; ``w`` stored ``[in, out]`` as in
JAX) from the same start on the same batches with the same optimizer
(``torch.optim.SGD(lr, momentum=0.9)``, which is optax's
``sgd(lr, momentum=0.9)``: ``m ← g + 0.9 m``, ``θ ← θ − lr m``). Each
process runs one intra-op thread (``OMP_NUM_THREADS=1`` unless set), as
``torchrun`` starts several processes on one machine. Methods:

- ``torch:dense``: plain DDP, fp32 all-reduce;
- ``torch:fp16``: DDP with ``fp16_compress_hook`` (the all-reduce in float16);
- ``torch:power_sgd(R)``: DDP with ``powerSGD_hook``, rank ``R``, error
  feedback and warm start, PowerSGD from DDP's step ``START_POWER_SGD_ITER``
  on (the earliest DDP allows with error feedback; the steps before it
  all-reduce dense), all gradients in one bucket (over gloo, the hook's
  all-reduces of two buckets can reach the process group in a different
  order on each process, which aborts the job).

Each reports what ``bench_network``'s JAX worker reports: the median step
time (forward, backward with DDP's all-reduces, optimizer step), the compute
time (the same step with each process's DDP over a process group of its own
alone, so the hooks still encode and decode, every process at once), the
bytes each worker sends per step under the ring model (``2 (n - 1) / n``
times what is all-reduced, as ``commopt.wire`` counts an all-reduce), the
training loss per step (mean over workers), the model's loss on the digits
``bench_network`` scores every method on after each step (untimed), and the
final model's loss on all the digits.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import sys
import time

START_POWER_SGD_ITER = 2
"""DDP step from which PowerSGD compresses (DDP requires at least 2 with error feedback)."""
SCRIPT = pathlib.Path(__file__).resolve()
"""This file: the script the launcher runs as the peer's processes."""


def unavailable() -> str | None:
  """Why the PyTorch peer cannot run in this environment, or None."""
  try:
    import torch
    import torch.distributed as dist
  except Exception as e:     # ImportError, or a broken install (missing shared library)
    return f"`import torch` failed ({type(e).__name__}: {e})"
  if not dist.is_available() or not dist.is_gloo_available():
    return f"torch {torch.__version__} has no gloo backend for torch.distributed"
  return None


def parse(label: str) -> tuple[str, int]:
  """``torch:dense`` -> ("dense", 0); ``torch:power_sgd(2)`` -> ("power_sgd", 2)."""
  if not label.startswith("torch:"):
    raise ValueError(f"not a torch method: {label!r}")
  kind = label[len("torch:"):]
  if kind in ("dense", "fp16"):
    return kind, 0
  if kind.startswith("power_sgd(") and kind.endswith(")"):
    return "power_sgd", int(kind[len("power_sgd("):-1])
  raise ValueError(f"unknown torch method {label!r}: torch:dense, torch:fp16 or "
                   "torch:power_sgd(RANK)")


def reduced_bytes(label: str, shapes) -> int:
  """Bytes one worker puts into all-reduces per step (after PowerSGD's dense start).

  PowerSGD's rule (``powerSGD_hook``): a tensor of one dimension goes dense
  (float32), as does a matrix ``[rows, cols]`` (the tensor viewed as
  ``[shape[0], -1]``) unless ``rank (rows + cols) * min_compression_rate (2)
  < rows cols``; a compressed one all-reduces ``P [rows, r]`` and
  ``Q [cols, r]``, ``r = min(rank, rows, cols)``, in float32.
  """
  kind, rank = parse(label)
  sizes = [_numel(s) for s in shapes]
  if kind == "dense":
    return 4 * sum(sizes)
  if kind == "fp16":
    return 2 * sum(sizes)
  total = 0
  for shape, size in zip(shapes, sizes):
    if len(shape) <= 1:
      total += 4 * size
      continue
    rows, cols = shape[0], size // shape[0]
    r = min(rank, rows, cols)
    total += 4 * ((rows + cols) * r if (rows + cols) * r * 2 < rows * cols else rows * cols)
  return total


def peer_arrays(hidden: int, path: pathlib.Path) -> dict:
  """Writes the JAX side's initial MLP weights and the digits for the PyTorch peer; its config."""
  import numpy as np

  from harness import data
  digits = data.digits_cnn()
  params0, _ = digits.mlp_fns(hidden)
  x_all, y_all = digits.load_digits_flat()
  layers = sorted(params0)
  np.savez(path, x=x_all, y=y_all, scored=data.eval_rows(len(x_all)),
           **{f"{k}.{leaf}": params0[k][leaf] for k in layers for leaf in ("w", "b")})
  return {"arrays": str(path), "layers": layers}


def sent_bytes(label: str, shapes, workers: int) -> float:
  """What one worker sends per step under the ring model: ``2 (n - 1) / n`` of what it reduces."""
  return 2 * (workers - 1) / workers * reduced_bytes(label, shapes)


def _numel(shape) -> int:
  n = 1
  for d in shape:
    n *= int(d)
  return n


def main(config_path: str, result_path: str) -> None:
  from commopt import launch
  process_id = int(os.environ.get(launch.ENV_PROCESS_ID, 0))
  workers = int(os.environ.get(launch.ENV_NUM_PROCESSES, 1))
  # Die with the launcher, however it ends; end at once on an uncaught exception.
  launch._die_with_launcher(process_id)
  sys.excepthook = launch._exit_after(sys.excepthook)

  import numpy as np
  # One intra-op thread per process unless OMP_NUM_THREADS says otherwise, as torchrun starts
  # several processes on one machine: with more, OpenMP's spinning threads of processes that
  # share the cores slowed DDP's steps several times over, and erratically.
  os.environ.setdefault("OMP_NUM_THREADS", "1")
  import torch
  import torch.distributed as dist
  import torch.nn.functional as F
  from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
  from torch.nn.parallel import DistributedDataParallel as DDP

  from harness.data import batch_rows    # the same batches as the JAX side
  cfg = json.loads(pathlib.Path(config_path).read_text())
  arrays = np.load(cfg["arrays"])
  x_all, y_all = arrays["x"], arrays["y"].astype(np.int64)
  scored = arrays["scored"]          # the digits the time to the target is counted on
  layers = cfg["layers"]
  init = [(arrays[f"{name}.w"], arrays[f"{name}.b"]) for name in layers]
  rows = cfg["batch"]

  # The launcher's coordinator address: a port it found free inside the namespace.
  host, port = os.environ.get(launch.ENV_COORDINATOR, "127.0.0.1:29500").rsplit(":", 1)
  os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
  os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
  dist.init_process_group("gloo", rank=process_id, world_size=workers,
                          timeout=datetime.timedelta(seconds=cfg.get("collective_timeout", 600)))
  # A group of one per process, for the compute-alone steps (every rank creates every group).
  alone = [dist.new_group([r]) for r in range(workers)][process_id]

  class MLP(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(w)) for w, _ in init])
      self.b = torch.nn.ParameterList([torch.nn.Parameter(torch.tensor(b)) for _, b in init])

    def forward(self, x):
      for i, (w, b) in enumerate(zip(self.w, self.b)):
        x = x @ w + b
        x = torch.relu(x) if i < len(init) - 1 else x
      return x

  def my_rows(step):
    idx = batch_rows(len(x_all), step, rows * workers)
    mine = np.split(idx, workers)[process_id]
    return torch.from_numpy(x_all[mine]), torch.from_numpy(y_all[mine])

  def ddp_for(label, group):
    """A fresh model from the shared start, DDP over ``group`` with the method's hook."""
    kind, rank = parse(label)
    # DDP's default buckets for dense and fp16. PowerSGD's hook chains its all-reduces on
    # futures, and over gloo the chains of two buckets can reach the process group in a different
    # order on each process (a collective mismatch that aborts the job): one bucket for it.
    one_bucket = -(-sum(w.nbytes + b.nbytes for w, b in init) // 2**20) + 1
    model = DDP(MLP(), process_group=group,
                bucket_cap_mb=one_bucket if kind == "power_sgd" else None)
    if kind == "fp16":
      model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif kind == "power_sgd":
      state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                 start_powerSGD_iter=START_POWER_SGD_ITER,
                                 use_error_feedback=True, warm_start=True)
      model.register_comm_hook(state, psgd.powerSGD_hook)
    return model, torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)

  def global_loss(model, rows) -> float:
    """The (replicated) model's loss on ``rows`` of the digits: each process scores its share,
    and the processes add up (untimed)."""
    share = np.array_split(rows, workers)[process_id]
    with torch.no_grad():
      part = F.cross_entropy(model(torch.from_numpy(x_all[share])),
                             torch.from_numpy(y_all[share]), reduction="sum").double()
    dist.all_reduce(part)
    return float(part) / len(rows)

  def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()        # DDP's all-reduces (and hooks) finish before backward returns
    opt.step()
    return loss

  shapes = [list(p.shape) for p in MLP().parameters()]
  results = {}
  for label in cfg["methods"]:
    model, opt = ddp_for(label, None)
    times, losses, global_losses = [], [], []
    for t in range(cfg["steps"]):
      x, y = my_rows(t)
      t0 = time.perf_counter()
      loss = step(model, opt, x, y)
      times.append(time.perf_counter() - t0)
      losses.append(float(loss.detach()))
      global_losses.append([t + 1, global_loss(model.module, scored)])
    gathered = [torch.zeros(len(losses), dtype=torch.float64) for _ in range(workers)]
    dist.all_gather(gathered, torch.tensor(losses, dtype=torch.float64))
    losses = torch.stack(gathered).mean(0).tolist()
    eval_loss = global_loss(model.module, np.arange(len(x_all)))
    # Compute alone: the same step with a group of this process alone, every process at once.
    local, local_opt = ddp_for(label, alone)
    x, y = my_rows(0)
    warm = START_POWER_SGD_ITER + 1 if parse(label)[0] == "power_sgd" else 1
    dist.barrier()
    compute = []
    for _ in range(warm + cfg["compute_steps"]):
      t0 = time.perf_counter()
      step(local, local_opt, x, y)
      compute.append(time.perf_counter() - t0)
    dist.barrier()
    step_s = statistics.median(times[1:])
    compute_s = statistics.median(compute[warm:])
    comm_s = max(step_s - compute_s, 0.0)
    sent = sent_bytes(label, shapes, workers)
    results[label] = {
        "step_s": step_s, "compute_s": compute_s, "comm_s": comm_s, "sent_bytes": sent,
        "dense_sent_bytes": sent_bytes("torch:dense", shapes, workers), "losses": losses,
        "step_times": times, "compile_s": times[0], "eval_loss": eval_loss,
        "global_losses": global_losses,
        "torch": torch.__version__,
    }
    if process_id == 0:
      print(f"  {label}: {step_s * 1e3:.1f} ms/step (compute {compute_s * 1e3:.1f}, "
            f"communication {comm_s * 1e3:.1f}), {sent / 1e6:.2f} MB sent/worker, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    del model, local
  dist.barrier()
  dist.destroy_process_group()
  if process_id == 0:
    pathlib.Path(result_path).write_text(json.dumps(results))


if __name__ == "__main__":
  sys.path[0] = str(SCRIPT.parents[1])     # benchmarks/, where `harness` is, not harness/ itself
  main(*sys.argv[1:3])
