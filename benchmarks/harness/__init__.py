"""What the benchmarks in ``benchmarks/`` share, imported by them as ``harness`` (each script
runs with its own folder, ``benchmarks/``, on ``sys.path``, and puts it there when it is
imported by path):

- :mod:`harness.netns`: network namespaces of a benchmark's own, shaped with ``tc``;
- :mod:`harness.jobs`: ``python -m commopt.launch`` jobs started inside them, and ended;
- :mod:`harness.data`: the bundled digits, their batches and the rows a model is scored on;
- :mod:`harness.arrays`: host arrays placed on the meshes of a multi-process job;
- :mod:`harness.models`: the regression MLPs and quantizers of the ZeRO benchmarks;
- :mod:`harness.trainers`: commopt's methods as the network benchmark trains and times them;
- :mod:`harness.torch_peer`: the PyTorch DDP peer (a script the launcher runs);
- :mod:`harness.timing`: timed calls, rounds of them and their statistics;
- :mod:`harness.hlo`: what a compiled program's collectives send and wait for;
- :mod:`harness.summary`: derived figures, tables and verdicts;
- :mod:`harness.plots`: figures;
- :mod:`harness.faults`: faults injected into steps and launched jobs, and how each is classed.
"""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
"""The repository."""
RESULTS = ROOT / "benchmarks" / "results"
"""Where the benchmarks write by default (``--out``)."""
