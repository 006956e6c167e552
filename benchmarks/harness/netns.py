"""Network namespaces of a benchmark's own, their links shaped by ``tc qdisc ... tbf``.

A :class:`Namespace` is one namespace whose loopback every process of a job shares (workers
behind one link); :class:`Nodes` is two namespaces joined by a veth pair (two machines).
Both need root (``ip netns``, ``tc``); :func:`why_not_shaped` says why a machine cannot
run them, and :func:`report_skip` writes the report of a benchmark that measured nothing.
Namespaces are named ``commopt-net-<pid>-<random>`` (``commopt-node<r>-<pid>-<random>``)
and always deleted, on errors and Ctrl-C too; the host's own interfaces are never touched.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import subprocess

BURST = {"1gbit": "128kb", "10gbit": "1280kb"}
"""tbf bucket per rate: at least rate / HZ (one timer tick of data)."""


def sh(*cmd, check=True) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, check=check)


def cannot_shape() -> str | None:
  """Why this machine cannot run the benchmark, or None."""
  if os.geteuid() != 0:
    return "needs root to create a network namespace and shape it with tc (run it with sudo)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"needs the `{tool}` command (iproute2)"
  return None


def rate_bits(rate: str) -> float:
  units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
  for suffix, scale in units.items():
    if rate.endswith(suffix):
      return float(rate[:-len(suffix)]) * scale
  raise ValueError(f"--bandwidths: cannot read the rate {rate!r} (use e.g. 1gbit, 500mbit)")


class Namespace:
  """A network namespace of this benchmark's own, with its loopback up; deleted on exit."""

  def __init__(self):
    self.name = f"commopt-net-{os.getpid()}-{secrets.token_hex(3)}"

  def __enter__(self):
    sh("ip", "netns", "add", self.name)
    try:
      sh("ip", "-n", self.name, "link", "set", "lo", "up")
    except BaseException:
      self.delete()
      raise
    return self

  def shape(self, rate: str) -> None:
    sh("tc", "-n", self.name, "qdisc", "del", "dev", "lo", "root", check=False)
    if rate != "unlimited":
      burst = BURST.get(rate, "128kb")
      sh("tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
         "burst", burst, "latency", "20ms")

  def delete(self) -> None:
    sh("ip", "netns", "del", self.name, check=False)

  def __exit__(self, *exc):
    self.delete()


class Nodes:
  """Two network namespaces joined by a veth pair, each with its loopback up and this host's
  name resolving to its own address (``/etc/netns/<namespace>/hosts``, which ``ip netns exec``
  puts in place of ``/etc/hosts``); all of it removed on exit."""

  def __init__(self):
    tag = f"{os.getpid()}-{secrets.token_hex(3)}"
    self.names = [f"commopt-node{r}-{tag}" for r in range(2)]
    self.links = [f"cn{r}{tag[-6:]}" for r in range(2)]      # at most 15 characters
    net = random.Random(tag).randrange(16, 32)
    sub = random.Random(tag[::-1]).randrange(1, 255)
    self.addresses = [f"172.{net}.{sub}.{r + 1}" for r in range(2)]

  def __enter__(self):
    try:
      for name, address in zip(self.names, self.addresses):
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        folder = pathlib.Path("/etc/netns", name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
      sh("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
      for name, link, address in zip(self.names, self.links, self.addresses):
        sh("ip", "link", "set", link, "netns", name)
        sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", link)
        sh("ip", "-n", name, "link", "set", link, "up")
    except BaseException:
      self.delete()
      raise
    return self

  def shape(self, rate: str) -> None:
    """Both directions of the link between the nodes limited to ``rate`` (or not)."""
    for name, link in zip(self.names, self.links):
      sh("tc", "-n", name, "qdisc", "del", "dev", link, "root", check=False)
      if rate != "unlimited":
        sh("tc", "-n", name, "qdisc", "add", "dev", link, "root", "tbf", "rate", rate,
           "burst", "256kb" if rate.endswith("gbit") else "128kb", "latency", "20ms")

  def delete(self) -> None:
    for name in self.names:
      sh("ip", "netns", "del", name, check=False)      # its end of the veth pair with it
      shutil.rmtree(pathlib.Path("/etc/netns", name), ignore_errors=True)

  def __exit__(self, *exc):
    self.delete()


def why_not_shaped(make=Namespace, cannot: str = "cannot create a network namespace") -> str | None:
  """Why this machine cannot run a shaped benchmark, or None when it can (namespaces of this
  benchmark's own, ``make()``, are created and deleted to find out; ``cannot`` opens the
  reason when that fails)."""
  reason = cannot_shape()
  if reason is None:
    try:
      with make():
        pass
    except subprocess.CalledProcessError as e:
      reason = f"{cannot}: {e.stderr.strip() or e}"
  return reason


def report_skip(name: str, path: pathlib.Path, reason: str, meta: dict | None = None,
                end: str = ".", indent: int | None = 1) -> int:
  """Says that benchmark ``name`` measured nothing, and why, and writes ``{"skipped": reason,
  **meta}`` to ``path`` as its report; 0, the benchmark's exit status."""
  print(f"{name}: skipped, {reason}{end}")
  path.write_text(json.dumps({"skipped": reason, **(meta or {})}, indent=indent))
  return 0


def interrupt_on_sigterm() -> None:
  """SIGTERM ends the run like Ctrl-C, so that the namespaces are deleted either way."""
  signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
