"""Figures (matplotlib, drawn off screen)."""

from __future__ import annotations

import pathlib

from harness.data import EVAL_ROWS
from harness.netns import rate_bits
from harness.trainers import COMBINED, EAGER, OVERLAPPED, TORCH_METHODS, order


def pyplot():
  """``matplotlib.pyplot``, drawing off screen (the Agg backend)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def time_to_target(results: dict, bandwidths, processes, target: float,
                   path: pathlib.Path) -> None:
  """``bench_network.py``'s figure, from derived rows: time to the target loss against the
  loopback's rate, one line per method, one panel per process count."""
  plt = pyplot()
  shaped = [b for b in bandwidths if b != "unlimited"]
  xs = {b: rate_bits(b) / 1e9 for b in shaped}
  palette = [*plt.cm.tab20.colors, *plt.cm.tab20b.colors]    # one colour per known method
  fig, axes = plt.subplots(1, len(processes), figsize=(6.5 * len(processes), 4.5), squeeze=False)
  for ax, n in zip(axes[0], processes):
    by_bw = results.get(str(n), {})
    methods = sorted({m for rows in by_bw.values() for m in rows}, key=order)
    top = max(xs.values(), default=1) * 4
    for m in methods:
      pts = [(xs.get(b, top), by_bw[b][m]["time_to_target_s"]) for b in bandwidths
             if m in by_bw.get(b, {}) and by_bw[b][m]["time_to_target_s"] is not None]
      if pts:
        pts.sort()
        # One colour per method in every panel.
        ax.plot(*zip(*pts), marker="o", label=m, color=palette[order(m) % len(palette)],
                linestyle="--" if m in TORCH_METHODS else ":" if m in COMBINED or m in OVERLAPPED
                or m in EAGER else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ticks = sorted(xs.values()) + ([top] if "unlimited" in bandwidths else [])
    ax.set_xticks(ticks, [f"{t:g}" for t in sorted(xs.values())]
                  + (["unlimited"] if "unlimited" in bandwidths else []))
    ax.set_xlabel("loopback rate (Gbit/s, tc tbf)")
    ax.set_ylabel(f"seconds to loss {target} (global model, {EVAL_ROWS} digits)")
    ax.set_title(f"{n} processes × 1 CPU device, gloo")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
