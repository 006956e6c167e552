"""benchmarks/harness: the benchmarks' shared machinery, its pure parts on hand-made inputs
(tables, summaries, timing rounds, rates, HLO reading, argument checks), and a shaped network
namespace where this machine can make one (root, ``ip``, ``tc``)."""

import json
import pathlib
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import data, faults, hlo, jobs, netns, plots, summary, timing, torch_peer  # noqa: E402
from harness import trainers  # noqa: E402


# -- summaries and tables --------------------------------------------------------------

def test_markdown_table_has_a_header_a_rule_and_a_line_per_row():
  assert summary.markdown_table(["a", "b c"], [["1", "2"], ["x", ""]]) == (
      "| a | b c |\n|---|---|\n| 1 | 2 |\n| x |  |")
  assert summary.markdown_table(["only"], []) == "| only |\n|---|"


def test_first_reaching_and_smoothed():
  assert summary.first_reaching([[8, 0.9], [16, 0.2], [24, 0.1]], 0.3) == 16
  assert summary.first_reaching(enumerate([2.0, 1.0, 0.5], 1), 0.5) == 3
  assert summary.first_reaching(enumerate([2.0, 1.0], 1), 0.5) is None
  assert summary.smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_meta_names_the_machine_and_adds_the_extra():
  info = summary.meta(load_before=(1.0, 2.0, 3.0))
  assert list(info) == ["host", "cpus", "python", "argv", "load_before"]
  assert info["argv"] == sys.argv[1:]


def network_row(step_s, comm_s=0.01, losses=(2.0, 1.0, 0.2), **extra):
  return {"step_s": step_s, "compute_s": step_s - comm_s, "comm_s": comm_s, "sent_bytes": 1e6,
          "losses": list(losses), "step_times": [5.0] + [step_s] * (len(losses) - 1), **extra}


def test_network_table_prints_every_row_against_dense():
  rows = {"dense": network_row(0.1),
          "scaled_sign/gather": network_row(0.05, losses=(2.0, 2.0, 2.0))}
  derived = {"2": {"1gbit": {m: summary.derive(r, 2, 0.3) for m, r in rows.items()}}}
  lines = summary.table(derived, ["1gbit"], [2]).splitlines()
  assert lines[0].startswith("| processes | bandwidth | method | step ms | × dense |")
  assert lines[1] == "|" + "---|" * 13
  # Dense reaches 0.3 (smoothed over up to 5 steps) at no step: the mean of the three is 1.07.
  assert lines[2] == ("| 2 | 1gbit | dense | 100.0 | 1.00 | 90.0 | 10.0 | 1.00 | 1.60 | "
                      "not reached | - | 1.067 | - |")
  assert lines[3].startswith("| 2 | 1gbit | scaled_sign/gather | 50.0 | 0.50 | 40.0 |")
  assert summary.verdicts(derived, ["1gbit"], [2]) == (
      "- 2 processes, 1gbit: per step, scaled_sign/gather is 2.00x faster than dense "
      "(50.0 against 100.0 ms).")


# -- timing rounds ---------------------------------------------------------------------

def test_interleaved_alternates_the_order_and_ratio_takes_the_median_of_rounds():
  calls = []
  runs = {k: (lambda n, k=k: calls.append(k) or {"a": 1.0, "b": 3.0}[k]) for k in "ab"}
  assert timing.interleaved(runs, rounds=3, steps=2) == {"a": [1.0] * 3, "b": [3.0] * 3}
  assert calls == ["a", "b", "b", "a", "a", "b"]
  assert timing.ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0


def test_round_medians_and_per_step():
  assert timing.round_medians([1, 2, 3, 10, 30, 20], 3) == [2, 20]
  assert timing.per_step([4.0, 1.0, 2.0, 3.0]) == 2.5
  # Runs of a period (each one exchange): the median of their means; a tail is left out.
  assert timing.per_step([1.0, 1.0, 4.0, 2.0, 2.0, 2.0, 9.0], 3) == 2.0
  assert timing.per_step([5.0, 7.0], 3) == 6.0


def fake_clock(monkeypatch, ticks):
  ticks = iter(ticks)
  monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))


def test_median_seconds_warms_up_then_takes_the_higher_middle(monkeypatch):
  calls = []
  fake_clock(monkeypatch, [0, 1, 10, 13, 20, 22, 30, 34])
  assert timing.median_seconds(lambda: calls.append(1), 4) == 3      # of 1, 3, 2, 4
  assert len(calls) == 5                                             # one untimed warm-up


def test_device_seconds_times_calls_queued_back_to_back(monkeypatch):
  calls = []
  fake_clock(monkeypatch, [0, 10, 100, 130, 200, 220])
  assert timing.device_seconds(lambda: calls.append(1), 3, batch=10) == 2.0   # of 1, 3, 2
  assert len(calls) == 1 + 3 * 10


def test_runner_goes_on_from_the_last_state():
  seen = []

  def step(p, s, batch):
    seen.append(p)
    return p + 1, s, None

  run = timing.runner(step, 0, None, "b")
  run(2)
  run(1)
  assert seen == [0, 1, 2]


# -- network rates, namespaces and jobs -------------------------------------------------

@pytest.mark.parametrize("rate, bits", [("1gbit", 1e9), ("500mbit", 5e8), ("64kbit", 64e3),
                                        ("8bit", 8.0), ("2.5gbit", 2.5e9)])
def test_rate_bits_reads_tc_rates(rate, bits):
  assert netns.rate_bits(rate) == bits


def test_rate_bits_names_an_unreadable_rate():
  with pytest.raises(ValueError, match="--bandwidths: cannot read the rate 'fast'"):
    netns.rate_bits("fast")


def test_why_not_shaped_says_why(monkeypatch):
  monkeypatch.setattr(netns, "cannot_shape", lambda: "needs root")
  assert netns.why_not_shaped() == "needs root"
  monkeypatch.setattr(netns, "cannot_shape", lambda: None)

  class Refused:
    def __enter__(self):
      raise subprocess.CalledProcessError(2, "ip", stderr="Operation not permitted\n")

    def __exit__(self, *exc):
      pass

  assert netns.why_not_shaped(Refused, "cannot build it") == (
      "cannot build it: Operation not permitted")


def test_report_skip_prints_and_writes_the_reason(tmp_path, capsys):
  assert netns.report_skip("bench_x", tmp_path / "x.json", "no root", {"cpus": 2}) == 0
  assert capsys.readouterr().out == "bench_x: skipped, no root.\n"
  assert json.loads((tmp_path / "x.json").read_text()) == {"skipped": "no root", "cpus": 2}
  netns.report_skip("bench_y", tmp_path / "y.json", "no tc", end="", indent=None)
  assert capsys.readouterr().out == "bench_y: skipped, no tc\n"
  assert (tmp_path / "y.json").read_text() == '{"skipped": "no tc"}'


def namespaces() -> set:
  out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_a_namespace_is_shaped_and_deleted():
  why = netns.why_not_shaped()
  if why:
    pytest.skip(f"no network namespace here: {why}")
  with netns.Namespace() as ns:
    assert ns.name in namespaces()
    ns.shape("1gbit")
    qdisc = netns.sh("tc", "-n", ns.name, "qdisc", "show", "dev", "lo").stdout
    assert "tbf" in qdisc and "1Gbit" in qdisc
    ns.shape("unlimited")
    assert "tbf" not in netns.sh("tc", "-n", ns.name, "qdisc", "show", "dev", "lo").stdout
  assert ns.name not in namespaces()


def test_driver_out_runs_the_worker_in_a_job_and_makes_the_folder_in_the_driver(tmp_path):
  ran = []
  worker = lambda config, result: ran.append((config, result))
  args = types.SimpleNamespace(worker=["c.json", "r.json"], out=str(tmp_path / "out"))
  assert jobs.driver_out(args, worker) is None and ran == [("c.json", "r.json")]
  assert not (tmp_path / "out").exists()
  args.worker = None
  assert jobs.driver_out(args, worker) == tmp_path / "out" and (tmp_path / "out").is_dir()


# -- the network benchmark's methods, data and PyTorch peer -----------------------------

def test_the_catalogue_refers_to_itself():
  assert len(set(trainers.ALL_METHODS)) == len(trainers.ALL_METHODS)
  assert all(combined in trainers.COMBINED for combined, _ in trainers.EAGER.values())
  assert all(m in trainers.METHODS for m in trainers.OVERLAPPED.values())
  assert trainers.order("dense") == 0
  assert trainers.order("a method of another version") == len(trainers.ALL_METHODS)


def test_make_tx_gives_each_method_its_period():
  assert trainers.make_tx("dense", 0.1)[1:] == (1, False)
  assert trainers.make_tx("diloco(8)+scaled_sign", 0.1)[1:] == (8, True)
  assert trainers.combined_options("diloco(4)+int_quant(4)", 0.1)["period"] == 4


def test_batches_and_scored_rows_are_the_same_on_every_call():
  a, b = data.batch_rows(1797, 3, 64), data.batch_rows(1797, 3, 64)
  assert (a == b).all() and len(set(a.tolist())) == 64
  assert not (data.batch_rows(1797, 4, 64) == a).all()
  scored = data.eval_rows(1797)
  assert len(scored) == data.EVAL_ROWS and (scored[1:] > scored[:-1]).all()
  assert len(data.eval_rows(100)) == 100


def test_torch_peer_counts_what_ddp_all_reduces():
  assert torch_peer.parse("torch:power_sgd(2)") == ("power_sgd", 2)
  assert torch_peer.parse("torch:fp16") == ("fp16", 0)
  with pytest.raises(ValueError, match="unknown torch method"):
    torch_peer.parse("torch:top_k")
  shapes = [[100, 50], [50]]
  assert torch_peer.reduced_bytes("torch:dense", shapes) == 4 * 5050
  assert torch_peer.reduced_bytes("torch:fp16", shapes) == 2 * 5050
  # P [100, 2] and Q [50, 2] for the matrix, the vector dense.
  assert torch_peer.reduced_bytes("torch:power_sgd(2)", shapes) == 4 * (300 + 50)
  assert torch_peer.sent_bytes("torch:dense", shapes, 4) == 1.5 * 4 * 5050
  assert torch_peer.SCRIPT.name == "torch_peer.py" and torch_peer.SCRIPT.exists()
  assert torch_peer.unavailable() is None or "torch" in torch_peer.unavailable()


def test_time_to_target_plot_is_drawn(tmp_path):
  pytest.importorskip("matplotlib")
  row = lambda ttt: {"time_to_target_s": ttt}
  results = {"2": {"1gbit": {"dense": row(3.0), "torch:dense": row(2.0)},
                   "unlimited": {"dense": row(1.0), "torch:dense": row(None)}}}
  plots.time_to_target(results, ["1gbit", "unlimited"], [2], 0.3, tmp_path / "t.png")
  assert (tmp_path / "t.png").stat().st_size > 0


# -- HLO and faults --------------------------------------------------------------------

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%branch (p: f32[4]) -> f32[4] {
  %p = f32[4] parameter(0)
  ROOT %ar2 = f32[4] all-reduce(%p), replica_groups={}, to_apply=%add
}

ENTRY %main (w: f32[4], x: f32[8]) -> f32[4] {
  %w = f32[4] parameter(0), metadata={op_name="params"}
  %x = f32[8] parameter(1), metadata={op_name="batch['x']"}
  %ar = f32[4] all-reduce(%w), replica_groups={}, to_apply=%add
  %sl = f32[4] slice(%x), slice={[0:4]}
  %ag = f32[8] all-gather(%sl), dimensions={0}
  ROOT %c = f32[4] call(%ar), to_apply=%branch
}
"""


def test_batch_dependent_collectives_follow_the_batch_through_calls():
  found = hlo.batch_dependent_collectives(HLO)
  assert found == [
      {"name": "ar", "kind": "all-reduce", "shape": "f32[4]", "batch": False},
      {"name": "ag", "kind": "all-gather", "shape": "f32[8]", "batch": True},
      {"name": "c/ar2", "kind": "all-reduce", "shape": "f32[4]", "batch": False}]
  assert hlo.waiting(found) == "1 of 3 (f32[8])"
  assert hlo.waiting([c for c in found if not c["batch"]]) == "0 of 2"
  assert hlo.waiting([]) == "-"


def test_a_bad_call_is_classed_by_its_error():
  def raises(error):
    def call():
      raise error
    return call

  assert faults.try_call(raises(TypeError("`bits` must be an integer")), "bits") == "clear"
  assert faults.try_call(raises(ValueError("ratio must be in (0, 1]")), "ratio") == "clear"
  assert faults.try_call(raises(ValueError("the ratios must be positive")), "ratio") == "unclear"
  assert faults.try_call(raises(ZeroDivisionError("bits")), "bits") == "unclear"
  assert faults.try_call(lambda: None, "bits") == "silent"


# -- the benchmarks' arguments ----------------------------------------------------------

@pytest.mark.parametrize("script, argv, message", [
    ("bench_overlap.py", ["--processes", "1"], "--processes must be at least 2, got 1"),
    ("bench_overlap.py", ["--variants", "split,fused"], "--variants: unknown ['fused']"),
    ("bench_overlap_diloco.py", ["--steps", "30", "--period", "20"],
     "--steps (30) must be a multiple of --period (20)"),
    ("bench_network.py", ["--bandwidths", "1gbit", "--processes", "1"],
     "--processes: each count must be at least 2"),
    ("bench_network.py", ["--methods", "dense,fast"], "--methods: unknown ['fast']")])
def test_bad_arguments_are_named(load_script, capsys, script, argv, message):
  with pytest.raises(SystemExit):
    load_script(ROOT / "benchmarks" / script).parse_args(argv)
  assert message in capsys.readouterr().err
