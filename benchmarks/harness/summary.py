"""Figures derived from measurements, and the tables and verdicts a benchmark prints.

Generic: :func:`markdown_table`, :func:`meta` (the machine a report was measured on),
:func:`smoothed` and :func:`first_reaching` (the step a loss curve reaches a target at).
The network benchmark's (``bench_network.py``): :func:`derive` (time to the target loss and
achieved rates), :func:`table`, :func:`verdicts` (commopt's methods against its dense) and
:func:`summarize` with :func:`summary_table` and :func:`comparison_lines` (commopt against
PyTorch, one method per role of :data:`ROLES`).
"""

from __future__ import annotations

import os
import platform
import sys

from harness.trainers import COMBINED, EAGER, METHODS, OVERLAPPED, TORCH_METHODS


def markdown_table(head, rows) -> str:
  """A Markdown table: the header ``head`` and one line per row of ``rows`` (cells as text)."""
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(cells) + " |" for cells in rows]
  return "\n".join(lines)


def meta(**extra) -> dict:
  """The machine and command line a report was measured with, and ``extra``."""
  return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
          "argv": sys.argv[1:], **extra}


def smoothed(losses, window=5):
  out = []
  for i in range(len(losses)):
    part = losses[max(0, i - window + 1):i + 1]
    out.append(sum(part) / len(part))
  return out


def first_reaching(losses, target: float):
  """The step of the first ``(step, loss)`` of ``losses`` whose loss is at most ``target``, or
  None."""
  return next((k for k, v in losses if v <= target), None)


# -- bench_network.py's rows -----------------------------------------------------------

def derive(r: dict, processes: int, target: float) -> dict:
  """Time to the target loss and achieved rates, from one method's measurements.

  The steps to the target: the first step after which the global model scores the target on
  :data:`harness.data.EVAL_ROWS` digits (a periodic method's anchor moves only when it
  synchronises). A report of an earlier version, which has no such scores, counts on the
  workers' training loss (smoothed) instead.
  """
  curve = smoothed(r["losses"])
  done = first_reaching(r.get("global_losses") or enumerate(curve, 1), target)
  # The compiling steps count as typical ones (a report without `compiled_at`: the first
  # `compiling_steps`).
  compiled = set(r.get("compiled_at", range(r.get("compiling_steps", 1))))
  times = [r["step_s"] if i in compiled else t for i, t in enumerate(r["step_times"])]
  comm = r["comm_s"]
  return dict(r, final_loss=curve[-1], steps_to_target=done,
              time_to_target_s=None if done is None else sum(times[:done]),
              # What one worker sends, and what all of them put through the one link.
              achieved_bytes_per_s=r["sent_bytes"] / comm if comm > 0 else None,
              link_bytes_per_s=r["sent_bytes"] * processes / comm if comm > 0 else None)


def derived(report: dict, target: float) -> dict:
  """``report["results"]`` with each row's time to ``target`` and rates (:func:`derive`)."""
  return {n: {bw: {m: derive(r, int(n), target) for m, r in rows.items()}
              for bw, rows in by_bw.items()} for n, by_bw in report["results"].items()}


def table(results: dict, bandwidths, processes) -> str:
  """Every method's row per process count and bandwidth, from derived rows (:func:`derive`)."""
  head = ["processes", "bandwidth", "method", "step ms", "× dense", "compute ms", "comm ms",
          "MB sent/worker", "link Gbit/s", "steps to target", "time to target s", "final loss",
          "global model's loss"]
  lines = []
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      dense = rows.get("dense", {}).get("step_s")
      for label, r in rows.items():
        achieved, ttt, ev = r["link_bytes_per_s"], r["time_to_target_s"], r.get("eval_loss")
        lines.append([
            str(n), bw, label, f"{r['step_s'] * 1e3:.1f}",
            f"{(r['step_s'] / dense) if dense else float('nan'):.2f}",
            f"{r['compute_s'] * 1e3:.1f}", f"{r['comm_s'] * 1e3:.1f}",
            f"{r['sent_bytes'] / 1e6:.2f}",
            '-' if not achieved else f'{achieved * 8 / 1e9:.2f}',
            f"{r['steps_to_target'] or 'not reached'}",
            '-' if ttt is None else f'{ttt:.1f}', f"{r['final_loss']:.3f}",
            '-' if ev is None else f'{ev:.3f}'])
  return markdown_table(head, lines)


def verdicts(results: dict, bandwidths, processes) -> str:
  """Per process count and bandwidth, among commopt's methods: the fastest compressed method per
  step against dense, and the soonest to the target loss, among the runs that reached it."""
  lines = []
  times = lambda a, b: f"{a / b:.2f}x faster" if a >= b else f"{b / a:.2f}x slower"
  for n in processes:
    for bw in bandwidths:
      rows = {m: r for m, r in results.get(str(n), {}).get(bw, {}).items()
              if m not in TORCH_METHODS}
      dense = rows.get("dense")
      others = [m for m in rows if m != "dense"]
      if dense is None or not others:
        continue
      best = min(others, key=lambda m: rows[m]["step_s"])
      line = (f"- {n} processes, {bw}: per step, {best} is {times(dense['step_s'], rows[best]['step_s'])} "
              f"than dense ({rows[best]['step_s'] * 1e3:.1f} against {dense['step_s'] * 1e3:.1f} ms)")
      reached = [m for m in others if rows[m]["time_to_target_s"] is not None]
      if reached and dense["time_to_target_s"] is not None:
        soon = min(reached, key=lambda m: rows[m]["time_to_target_s"])
        line += (f"; to the target loss, {soon} is {times(dense['time_to_target_s'], rows[soon]['time_to_target_s'])} "
                 f"({rows[soon]['time_to_target_s']:.1f} against {dense['time_to_target_s']:.1f} s)")
      slower = [m for m in others if rows[m]["step_s"] > dense["step_s"]]
      if slower:
        line += f"; slower than dense per step: {', '.join(slower)}"
      lines.append(line + ".")
  return "\n".join(lines)


ROLES = ("commopt dense", "commopt best compressed", "commopt best combined",
         "PyTorch dense", "PyTorch fp16", "PyTorch PowerSGD")
"""The rows of the summary: one method each, picked per process count and bandwidth."""


def soonest(rows: dict, labels) -> str | None:
  """The label soonest to the target; among none that reached it, the fastest per step."""
  labels = [m for m in labels if m in rows]
  if not labels:
    return None
  return min(labels, key=lambda m: (rows[m]["time_to_target_s"] is None,
                                    rows[m]["time_to_target_s"] or 0.0, rows[m]["step_s"]))


def summarize(results: dict, bandwidths, processes) -> dict:
  """Per process count and bandwidth, from derived rows: the method in each role (:data:`ROLES`)
  with its step time and time to the target, and commopt's best against PyTorch's best.

  ``{n: {bw: {"roles": {role: row}, "commopt_best": row, "torch_best": row,
  "commopt_not_slower": bool, "combined_vs_dense": float}}}``, a row being ``{"method",
  "step_s", "steps_to_target", "time_to_target_s"}`` (None where that side did not run).
  ``commopt_not_slower``: whether commopt's best reached the target no later than PyTorch's best
  (True where only commopt's reached it; None where neither did or a side did not run).
  ``combined_vs_dense``: commopt dense's time to the target over the best combined method's,
  None unless both reached it.
  """
  out: dict = {}
  for n in processes:
    for bw in bandwidths:
      rows = results.get(str(n), {}).get(bw, {})
      if not rows:
        continue
      torch = [m for m in rows if m.startswith("torch:")]
      ours = [m for m in rows if m not in torch]
      row = lambda m: None if m is None else {
          "method": m, "step_s": rows[m]["step_s"], "steps_to_target": rows[m]["steps_to_target"],
          "time_to_target_s": rows[m]["time_to_target_s"]}
      picks = {
          "commopt dense": "dense" if "dense" in rows else None,
          "commopt best compressed": soonest(rows, [m for m in ours if m in METHODS
                                                    and m != "dense"]),
          "commopt best combined": soonest(rows, [m for m in ours if m in COMBINED
                                                  or m in OVERLAPPED or m in EAGER
                                                  or m.startswith(("diloco(", "overlap:",
                                                                   "eager:", "eager("))]),
          "PyTorch dense": "torch:dense" if "torch:dense" in rows else None,
          "PyTorch fp16": "torch:fp16" if "torch:fp16" in rows else None,
          "PyTorch PowerSGD": soonest(rows, [m for m in torch if m.startswith("torch:power_sgd")]),
      }
      best_ours, best_torch = row(soonest(rows, ours)), row(soonest(rows, torch))
      ttt = lambda r: None if r is None else r["time_to_target_s"]
      if best_ours is None or best_torch is None or (ttt(best_ours) is None
                                                     and ttt(best_torch) is None):
        not_slower = None
      elif ttt(best_torch) is None or ttt(best_ours) is None:
        not_slower = ttt(best_ours) is not None
      else:
        not_slower = ttt(best_ours) <= ttt(best_torch)
      dense_t = ttt(row(picks["commopt dense"]))
      combined_t = ttt(row(picks["commopt best combined"]))
      out.setdefault(str(n), {})[bw] = {
          "roles": {role: row(m) for role, m in picks.items() if m is not None},
          "commopt_best": best_ours, "torch_best": best_torch, "commopt_not_slower": not_slower,
          "combined_vs_dense": dense_t / combined_t if dense_t and combined_t else None}
  return out


def summary_table(summary: dict) -> str:
  """The summary's rows: per process count and bandwidth, one method per role."""
  lines = []
  for n, by_bw in summary.items():
    for bw, s in by_bw.items():
      for role in ROLES:
        r = s["roles"].get(role)
        if r is not None:
          ttt = r["time_to_target_s"]
          lines.append([n, bw, role, r["method"], f"{r['step_s'] * 1e3:.1f}",
                        f"{r['steps_to_target'] or 'not reached'}",
                        '-' if ttt is None else f'{ttt:.2f}'])
  return markdown_table(["processes", "bandwidth", "role", "method", "step ms",
                         "steps to target", "time to target s"], lines)


def comparison_lines(summary: dict) -> str:
  """One verdict per process count and bandwidth: commopt's best against PyTorch's best, to the
  target loss; and commopt's best combined method against its dense."""
  def reached(side, r):
    t = r["time_to_target_s"]
    return f"{side}'s best, {r['method']}, " + ("did not reach the target" if t is None
                                                else f"reached it in {t:.2f} s")

  def sooner(a, b):      # a, b: seconds; how a compares with b
    return f"{b / a:.1f}x sooner" if a <= b else f"{a / b:.1f}x later"

  lines = []
  for n, by_bw in summary.items():
    for bw, s in by_bw.items():
      ours, theirs = s["commopt_best"], s["torch_best"]
      if ours is None or theirs is None:
        text = f"{'PyTorch' if theirs is None else 'commopt'} did not run: no verdict"
      else:
        verdict = {True: "commopt's best ≤ PyTorch's best: yes",
                   False: "commopt's best ≤ PyTorch's best: no",
                   None: "neither reached the target: no verdict"}[s["commopt_not_slower"]]
        text = f"{reached('commopt', ours)}; {reached('PyTorch', theirs)}: {verdict}"
        if ours["time_to_target_s"] and theirs["time_to_target_s"]:
          text += f" ({sooner(ours['time_to_target_s'], theirs['time_to_target_s'])})"
      if s["combined_vs_dense"] is not None:
        combined = s["roles"]["commopt best combined"]
        text += (f"; {combined['method']} against commopt dense: "
                 f"{sooner(1.0, s['combined_vs_dense'])} to the target")
      lines.append(f"- {n} processes, {bw}: {text}.")
  return "\n".join(lines)
