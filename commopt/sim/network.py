"""An α-β cost model of collectives, and the time a step's communication takes under it.

Every message costs ``α`` (latency, seconds) plus its bytes over ``β``
(bandwidth, bytes per second). The cost of a collective over ``n`` workers
then follows from the algorithm that runs it (Thakur, Rabenseifner and
Gropp, 2005). With ``S`` the bytes each worker puts in (its vector for an
all-reduce, reduce-scatter or all-to-all; its contribution for an
all-gather, whose output is ``n·S``) and ``L = ⌈log₂ n⌉``:

| collective     | ``"ring"``                    | ``"tree"``                                    |
|----------------|-------------------------------|-----------------------------------------------|
| all-reduce     | 2(n−1)α + 2(n−1)/n · S/β      | 2L(α + S/β) (binomial reduce, then broadcast) |
| reduce-scatter | (n−1)α + (n−1)/n · S/β        | Lα + (n−1)/n · S/β (recursive halving)        |
| all-gather     | (n−1)α + (n−1) · S/β          | Lα + (n−1) · S/β (recursive doubling)         |
| all-to-all     | (n−1)α + (n−1)/n · S/β        | Lα + L/2 · S/β (Bruck)                        |

``"shared"`` is one medium that every worker's traffic crosses (a hub, or
the one loopback of ``benchmarks/bench_network.py``): the ring's messages,
with all ``n`` workers' bytes serialised on it, ``(n−1)α`` per ring pass
plus ``n`` times one worker's ring bytes over ``β``.

A :class:`Network` gives each mesh axis its link and topology (a two-level
cluster: fast links inside a node, slow ones between nodes), and
:func:`predict` prices :func:`commopt.wire.comm_plan`'s collectives on it,
one after another, as XLA issues them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple, Optional

from commopt import wire
from commopt._src import base

TOPOLOGIES = ("ring", "tree", "shared")
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")


@dataclasses.dataclass(frozen=True)
class Link:
  """One link's latency ``α`` (seconds per message) and bandwidth ``β`` (bytes per second)."""
  latency: float
  bandwidth: float

  def __post_init__(self):
    base.check_number("latency", self.latency, fn="Link", low=0, low_open=False)
    base.check_number("bandwidth", self.bandwidth, fn="Link", low=0)

  @classmethod
  def gbit(cls, gbit_per_s: float, latency: float = 0.0) -> "Link":
    """A link of ``gbit_per_s`` gigabits per second and ``latency`` seconds per message."""
    base.check_number("gbit_per_s", gbit_per_s, fn="Link.gbit", low=0)
    return cls(latency=latency, bandwidth=gbit_per_s * 1e9 / 8)


def _log2(n: int) -> int:
  return math.ceil(math.log2(n))


def collective_time(kind: str, group_size: int, nbytes: float, link: Link,
                    topology: str = "ring") -> float:
  """Seconds a collective takes under the α-β model (see the module's table).

  Args:
    kind: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"`` or ``"all-to-all"``.
    group_size: the workers taking part, ``n``.
    nbytes: the bytes each worker puts in, ``S``.
    link: the links between them.
    topology: ``"ring"``, ``"tree"`` or ``"shared"``.

  Examples:
    >>> from commopt.sim import network
    >>> link = network.Link(latency=1e-5, bandwidth=1e9)
    >>> round(network.collective_time("all-reduce", 4, 1e6, link), 6)   # 6α + 1.5 S/β
    0.00156

  References:
    Hockney, The Communication Challenge for MPP: Intel Paragon and Meiko
    CS-2, Parallel Computing 1994 (the α-β model).
    Thakur, Rabenseifner and Gropp, Optimization of Collective Communication
    Operations in MPICH, IJHPCA 2005.
    Patarasuk and Yuan, Bandwidth Optimal All-reduce Algorithms for Clusters
    of Workstations, JPDC 2009 (the ring all-reduce).
  """
  base.check_choice("kind", kind, KINDS, "collective_time")
  base.check_choice("topology", topology, TOPOLOGIES, "collective_time")
  n = base.check_positive_int("group_size", group_size, fn="collective_time")
  s = base.check_number("nbytes", nbytes, fn="collective_time", low=0, low_open=False)
  if n == 1:
    return 0.0
  a, b = link.latency, 1.0 / link.bandwidth
  if topology == "tree":
    steps = _log2(n)
    return {"all-reduce": 2 * steps * (a + s * b),
            "reduce-scatter": steps * a + (n - 1) / n * s * b,
            "all-gather": steps * a + (n - 1) * s * b,
            "all-to-all": steps * a + steps / 2 * s * b}[kind]
  passes = 2 if kind == "all-reduce" else 1
  ring_bytes = wire.ring_sent_bytes(kind, s, n)
  if topology == "shared":
    return passes * (n - 1) * a + n * ring_bytes * b
  return passes * (n - 1) * a + ring_bytes * b


@dataclasses.dataclass(frozen=True)
class Network:
  """Links and topologies per mesh axis.

  Attributes:
    link: the link of every axis not in ``axes``.
    topology: its topology, one of :data:`TOPOLOGIES`.
    axes: ``{axis: (link, topology)}`` for axes with links of their own.
  """
  link: Link
  topology: str = "ring"
  axes: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    base.check_choice("topology", self.topology, TOPOLOGIES, "Network")
    for axis, (link, topology) in self.axes.items():
      if not isinstance(link, Link):
        raise ValueError(f"Network: `axes[{axis!r}]` must be (Link, topology), got {link!r}.")
      base.check_choice(f"axes[{axis!r}] topology", topology, TOPOLOGIES, "Network")

  @classmethod
  def two_level(cls, intra: Link, inter: Link, *, fast_axis: str = "local",
                topology: str = "ring") -> "Network":
    """A cluster of nodes: ``intra`` links on ``fast_axis`` (inside a node), ``inter`` on
    every other axis (between nodes)."""
    return cls(link=inter, topology=topology, axes={fast_axis: (intra, topology)})

  def time(self, planned: wire.Planned) -> float:
    """Seconds one planned collective takes on its axis's links."""
    link, topology = self.axes.get(planned.axis, (self.link, self.topology))
    return collective_time(planned.kind, planned.group_size, planned.contributed_bytes, link,
                           topology)


class Prediction(NamedTuple):
  """What :func:`predict` expects of one step.

  Attributes:
    sent_bytes: bytes one worker sends (ring model).
    comm_s: seconds of communication, the collectives one after another.
    step_s: ``compute_s + comm_s``: nothing overlaps.
    dense_comm_s: the seconds a flat dense all-reduce of every leaf over all
      workers would take on ``network.link`` with ``network.topology`` (the
      slow links of :meth:`Network.two_level`): a job with no compression
      and no hierarchy.
  """
  sent_bytes: float
  comm_s: float
  step_s: float
  dense_comm_s: float


def predict(tx, params, workers, network: Network, *, compute_s: float = 0.0,
            step: Optional[int] = None, axis_name="data", strategy: str = "auto") -> Prediction:
  """Bytes and seconds of one step's communication for a reducing transform or compressor.

  Args:
    tx: as for :func:`commopt.wire.comm_plan`.
    params: as for :func:`commopt.wire.comm_plan`.
    workers: as for :func:`commopt.wire.comm_plan`.
    axis_name: as for :func:`commopt.wire.comm_plan`.
    strategy: as for :func:`commopt.wire.comm_plan`.
    step: as for :func:`commopt.wire.comm_plan`.
    network: the links.
    compute_s: the step's compute (gradient, encode and decode), measured.

  Returns:
    A :class:`Prediction`.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> from commopt.sim import network
    >>> net = network.Network(network.Link.gbit(1.0))
    >>> p = network.predict(commopt.scaled_sign(), {"w": jnp.zeros((1024, 1024))}, 8, net)
    >>> round(p.dense_comm_s / p.comm_s, 1)        # 7 sign payloads received vs a dense ring
    8.0
  """
  compute_s = base.check_number("compute_s", compute_s, fn="predict", low=0, low_open=False)
  plan = wire.comm_plan(tx, params, workers, axis_name=axis_name, strategy=strategy, step=step)
  comm = sum(network.time(c) for c in plan.collectives)
  total = math.prod(workers) if isinstance(workers, tuple) else workers
  dense = collective_time("all-reduce", total, plan.dense_bytes, network.link, network.topology)
  return Prediction(sent_bytes=plan.sent_bytes, comm_s=comm, step_s=compute_s + comm,
                    dense_comm_s=dense)
