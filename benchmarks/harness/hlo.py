"""What a compiled program's collectives send and wait for, read from its HLO text."""

from __future__ import annotations

import math
import re

_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|"
                         r"collective-permute)(?:-start)?\(")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEAD = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*[(]")


def _computations(hlo_text: str) -> tuple[dict, str]:
  """``({name: [(instruction, rest of its line)]}, entry name)`` of an HLO module's text."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    head = _HEAD.match(line)
    if head:
      current = head.group(2)
      comps[current] = []
      entry = current if head.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      m = _DEF.match(line)
      if m:
        comps[current].append(m.groups())
  return comps, entry


def batch_dependent_collectives(hlo_text: str) -> list[dict]:
  """Every collective of a compiled program, and whether it waits for the batch.

  A collective of the entry computation waits when it depends, through any chain of
  instructions, on a parameter holding the batch (``op_name`` starting with ``batch``).
  One inside a computation the entry calls (a conditional's branch, a loop's body)
  starts only once that call's operands are ready, so it waits when the call does. A
  collective that does not wait can run while the forward and backward pass do.
  Returns ``[{"name", "kind", "shape", "batch": bool}]`` in program order.
  """
  comps, entry = _computations(hlo_text)

  def inside(name, seen=()):
    """The collectives in computation ``name`` and the computations it calls."""
    out = []
    for inst, rest in comps.get(name, []):
      kind = _COLLECTIVE.search(rest)
      if kind:
        out.append((inst, kind.group(1), rest.split(" ")[0]))
      for callee in re.findall(r"%([\w.\-]+)", rest):
        if callee in comps and callee not in seen and callee != name:
          out += inside(callee, seen + (name,))
    return out

  depends: dict[str, bool] = {}
  found = []
  for inst, rest in comps[entry]:
    operands = [t for t in re.findall(r"%([\w.\-]+)", rest) if t in depends]
    batch = ("parameter(" in rest and 'op_name="batch' in rest) or any(
        depends[t] for t in operands)
    depends[inst] = batch
    kind = _COLLECTIVE.search(rest)
    if kind:
      found.append({"name": inst, "kind": kind.group(1), "shape": rest.split(" ")[0],
                    "batch": batch})
    for callee in re.findall(r"%([\w.\-]+)", rest):
      if callee in comps and callee != entry:
        found += [{"name": f"{inst}/{n}", "kind": k, "shape": shape, "batch": batch}
                  for n, k, shape in inside(callee)]
  return found


def waiting(collectives: list[dict]) -> str:
  """``k of n (shapes)``: how many of :func:`batch_dependent_collectives`'s collectives wait
  for the batch, and their shapes; ``-`` for none."""
  if not collectives:
    return "-"
  waits = [c for c in collectives if c["batch"]]
  return f"{len(waits)} of {len(collectives)}" + (
      f" ({', '.join(sorted({c['shape'] for c in waits}))})" if waits else "")


def sent_bytes(hlo_text: str, mesh, local=None):
  """``(by kind, by mesh axes, across nodes direct, across nodes ring)``: the bytes one device
  sends per run of the compiled step ``hlo_text`` (a scan body's collectives once per
  iteration), with logical device ``d`` on node ``d // local`` (``local``: devices per node;
  None: no node counts). Direct: each peer sent its share itself, the shares to other nodes
  counted; ring: a collective's ring, devices ordered by node, crosses once per node."""
  import numpy as np
  import commopt
  by_kind, by_axis, direct, ring = {}, {}, 0.0, 0.0
  for c in commopt.wire.parse_hlo(hlo_text):
    by_kind[c.kind] = by_kind.get(c.kind, 0) + c.sent_bytes * c.trips
    coords = np.array([np.unravel_index(d, mesh.devices.shape) for d in c.replica_groups[0]])
    axes = "+".join(a for i, a in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1)
    by_axis[axes] = by_axis.get(axes, 0) + c.sent_bytes * c.trips
    if local is not None:     # logical device d sits on node d // local
      group = c.replica_groups[0]
      nodes = len({d // local for d in group})
      peers_away = sum(d // local != group[0] // local for d in group)
      direct += c.sent_bytes * c.trips * peers_away / max(1, len(group) - 1)
      ring += c.sent_bytes * c.trips * (nodes / len(group) if nodes > 1 else 0.0)
  return by_kind, by_axis, direct, ring


def axis_groups(mesh, axis):
  """The replica groups of collectives over ``axis``: a set of sorted tuples of device ids."""
  import numpy as np
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1).reshape(-1, mesh.shape[axis])
  return {tuple(sorted(int(i) for i in g)) for g in moved}


def on_groups(collective, groups) -> bool:
  """Whether every replica group of ``collective`` is one of ``groups``."""
  return bool(collective.replica_groups) and all(
      tuple(sorted(g)) in groups for g in collective.replica_groups)


def operand_bytes(collective):
  """``(shape, bytes)`` of each operand of ``collective`` (a combined collective has
  several), the bytes one device contributes, counted as ``commopt.wire`` counts
  ``contributed_bytes``."""
  n = max(collective.group_size, 1)
  out = []
  for dtype, shape in zip(collective.dtypes, collective.shapes):
    bits = 8 if dtype == "pred" else int("".join(ch for ch in dtype if ch.isdigit()))
    nbytes = -(-bits * math.prod(shape) // 8)
    nbytes = {"all-gather": nbytes // n, "reduce-scatter": nbytes * n}.get(collective.kind,
                                                                         nbytes)
    out.append((tuple(shape), nbytes))
  return out
