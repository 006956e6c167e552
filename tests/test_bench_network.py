"""The network benchmark: end to end, shortened (a shaped namespace, two processes, few steps;
slow), and its summary of commopt against PyTorch on hand-made rows (default tier)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_network.py"


@pytest.mark.slow
@pytest.mark.optimized   # asserts that a sign step beats a dense one on the shaped link
def test_bench_network_measures_a_shaped_link_and_cleans_up(tmp_path, run_bench):
  proc, left = run_bench(
      BENCH, ["--processes", "2", "--bandwidths", "1gbit", "--steps", "10", "--compute-steps", "3",
              "--hidden", "1024", "--methods", "dense,scaled_sign/gather", "--target-loss", "1.0",
              "--out", str(tmp_path)], timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "network.json").read_text())
  if "skipped" in report:
    assert "bench_network: skipped, " in proc.stdout
    pytest.skip(f"the benchmark cannot shape a network here: {report['skipped']}")
  assert not left                                     # its namespace is gone
  rows = report["results"]["2"]["1gbit"]
  dense, sign = rows["dense"], rows["scaled_sign/gather"]
  # Dense moves ~4.5 MB per worker per step through a 1 Gbit/s link shared by two
  # workers: the link, not the 2 cores, sets its step time. tbf's burst lets a short run
  # through faster than the rate (1.6 Gbit/s measured once, on a loaded machine); the
  # unshaped loopback carries tens of Gbit/s, so below 2 still shows the shaping.
  link = dense["sent_bytes"] * 2 / dense["comm_s"] * 8 / 1e9
  assert 0.3 < link < 2.0, link
  assert sign["sent_bytes"] * 25 < dense["sent_bytes"]
  assert sign["step_s"] < dense["step_s"]
  assert dense["losses"][-1] < dense["losses"][0]
  assert "| 2 | 1gbit | dense |" in proc.stdout
  assert (tmp_path / "network.png").stat().st_size > 10_000
  # The table re-renders from the JSON.
  again = subprocess.run([sys.executable, str(BENCH), "--from-json", str(tmp_path / "network.json"),
                          "--out", str(tmp_path / "re")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
  assert again.returncode == 0 and "| 2 | 1gbit | scaled_sign/gather |" in again.stdout
  # The α-β model beside the measurement: a bandwidth-bound dense step is priced
  # by its bytes over the shared link (the link check above bounds the error).
  model = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "network_model.py"),
                          "--from-json", str(tmp_path / "network.json"), "--out",
                          str(tmp_path / "model")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
  assert model.returncode == 0, model.stdout[-3000:] + model.stderr[-3000:]
  rows = json.loads((tmp_path / "model" / "network_model.json").read_text())["rows"]
  assert {r["method"] for r in rows} == {"dense", "scaled_sign/gather"}
  dense_row = next(r for r in rows if r["method"] == "dense")
  assert abs(dense_row["comm_error"]) < 0.7, dense_row
  assert "The α that fits" in model.stdout


def torch_missing():
  try:
    import torch  # noqa: F401
    import torch.distributed as dist
  except Exception as e:
    return f"{type(e).__name__}: {e}"
  return None if dist.is_available() and dist.is_gloo_available() else "torch without gloo"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["diloco(8)+scaled_sign", "torch:power_sgd(2)",
                                    "zero+qwZ+qgZ", "overlap:scaled_sign/gather",
                                    "eager:diloco(4)+int_quant(4)",
                                    "eager(w=1):diloco(4)+int_quant(4)"])
def test_bench_network_runs_a_combined_method_and_the_pytorch_peer(tmp_path, method, run_bench):
  if method.startswith("torch:") and torch_missing():
    pytest.skip(f"PyTorch is not importable here ({torch_missing()}); "
                "`pip install -e '.[peers]'` to run its peer")
  proc, left = run_bench(
      BENCH, ["--processes", "2", "--bandwidths", "1gbit", "--steps", "16", "--compute-steps", "3",
              "--hidden", "1024", "--methods", f"dense,{method}", "--target-loss", "1.0",
              "--out", str(tmp_path)], timeout=500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "network.json").read_text())
  if "skipped" in report:
    pytest.skip(f"the benchmark cannot shape a network here: {report['skipped']}")
  assert not left
  rows = report["results"]["2"]["1gbit"]
  dense, other = rows["dense"], rows[method]
  assert len(other["losses"]) == 16 and other["losses"][-1] < other["losses"][0]
  assert 0 < other["compute_s"] and 0 < other["step_s"]
  assert other["eval_loss"] < 2.0
  if method.startswith("zero"):
    # int8 weights gathered and int4 gradients scattered: under a third of the all-reduce
    # (4 bytes a coordinate twice); the same start, its weights seen through int8.
    assert other["sent_bytes"] * 3 < dense["sent_bytes"]
    assert abs(other["losses"][0] - dense["losses"][0]) < 0.05
    assert [k for k, _ in other["global_losses"]][:2] == [1, 2]
  elif method.startswith("diloco"):
    # One exchange of ~P/8 bytes (signs) every 8 steps, against a dense all-reduce each step.
    assert other["sent_bytes"] * 8 * 25 < dense["sent_bytes"] * 8
    assert [k for k, _ in other["global_losses"]] == [8, 16]
    # Its first period (compiling, then its first exchange) counts as typical steps.
    assert other["compiling_steps"] == 8 and other["compiled_at"] == [0, 7]
    assert other["step_s"] < dense["step_s"]
  elif method.startswith("eager"):
    # 4-bit pseudo-gradients every 4 steps; the mean anchor after each outer step, scored
    # after the run; its first two periods (compiling) count as typical steps.
    assert other["sent_bytes"] * 20 < dense["sent_bytes"]
    assert [k for k, _ in other["global_losses"]] == [4, 8, 12, 16]
    assert other["compiling_steps"] == 8 and other["compiled_at"] == [0, 3, 7]
    assert other["step_s"] < dense["step_s"]
    assert other["global_losses"][-1][1] < other["global_losses"][0][1]
  elif method.startswith("overlap:"):
    # scaled_sign's signs, one step late, beside the backward pass: the same first loss
    # (computed before any update), a model scored after every step.
    assert other["sent_bytes"] * 25 < dense["sent_bytes"]
    assert abs(other["losses"][0] - dense["losses"][0]) < 1e-3
    assert [k for k, _ in other["global_losses"]][:2] == [1, 2]
  else:
    # Ring model for two workers: each sends what it reduces; PowerSGD's P and Q, rank 2.
    assert other["dense_sent_bytes"] == dense["sent_bytes"]
    assert other["sent_bytes"] * 25 < dense["sent_bytes"]
    # The same start, batches and optimizer: the first losses agree with commopt dense's.
    assert abs(other["losses"][0] - dense["losses"][0]) < 1e-3
  summary = report["summary"]["2"]["1gbit"]
  assert summary["roles"]["commopt dense"]["method"] == "dense"
  assert "- 2 processes, 1gbit: " in proc.stdout
  assert f"| 2 | 1gbit | {method} |" in proc.stdout
  again = subprocess.run([sys.executable, str(BENCH), "--from-json", str(tmp_path / "network.json"),
                          "--target-loss", "0.5", "--out", str(tmp_path / "re")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
  assert again.returncode == 0 and f"| 2 | 1gbit | {method} |" in again.stdout, again.stderr


def test_bench_network_skips_the_pytorch_peer_without_torch(tmp_path):
  """An unimportable torch leaves its methods out with one message; nothing else is lost."""
  shadow = tmp_path / "shadow"
  (shadow / "torch").mkdir(parents=True)
  (shadow / "torch" / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
  env = dict(os.environ, PYTHONPATH=str(shadow))
  proc = subprocess.run(
      [sys.executable, str(BENCH), "--methods", "torch:dense,torch:fp16", "--out",
       str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("skipping torch:dense, torch:fp16: `import torch` failed") == 1
  assert "no torch in this test" in proc.stdout
  report = json.loads((tmp_path / "out" / "network.json").read_text())
  assert report["skipped"] == "no method left to measure"
  assert report["left_out"]["methods"] == ["torch:dense", "torch:fp16"]


def row(step_s, ttt, steps=10):
  return {"step_s": step_s, "time_to_target_s": ttt, "steps_to_target": None if ttt is None
          else steps}


def test_summary_picks_each_role_and_compares_the_best_of_each_side(load_script):
  b = load_script(BENCH)
  results = {"4": {
      "1gbit": {"dense": row(0.9, 11.0), "scaled_sign/gather": row(0.2, 3.0),
                "top_k(0.01)/gather": row(0.1, None), "diloco(8)+scaled_sign": row(0.06, 1.0),
                "diloco(4)+int_quant(4)": row(0.05, 1.5), "torch:dense": row(0.8, 9.0),
                "torch:fp16": row(0.5, 6.0), "torch:power_sgd(2)": row(0.1, 1.2)},
      "unlimited": {"dense": row(0.05, 0.6), "diloco(8)+scaled_sign": row(0.04, 0.8),
                    "torch:dense": row(0.03, 0.4)}},
      "2": {"1gbit": {"dense": row(0.5, None), "torch:dense": row(0.4, None)}}}
  s = b.summarize(results, ["1gbit", "unlimited"], [4, 2])
  one = s["4"]["1gbit"]
  picked = {role: r["method"] for role, r in one["roles"].items()}
  assert picked == {"commopt dense": "dense", "commopt best compressed": "scaled_sign/gather",
                    "commopt best combined": "diloco(8)+scaled_sign",
                    "PyTorch dense": "torch:dense", "PyTorch fp16": "torch:fp16",
                    "PyTorch PowerSGD": "torch:power_sgd(2)"}
  assert one["commopt_best"]["method"] == "diloco(8)+scaled_sign"
  assert one["torch_best"]["method"] == "torch:power_sgd(2)"
  assert one["commopt_not_slower"] is True and one["combined_vs_dense"] == pytest.approx(11.0)
  fast = s["4"]["unlimited"]
  assert fast["commopt_best"]["method"] == "dense" and fast["commopt_not_slower"] is False
  assert "PyTorch PowerSGD" not in fast["roles"]
  assert s["2"]["1gbit"]["commopt_not_slower"] is None        # neither reached the target
  assert list(s["2"]) == ["1gbit"]                            # no rows, no entry
  lines = b.comparison_lines(s).splitlines()
  assert lines[0] == ("- 4 processes, 1gbit: commopt's best, diloco(8)+scaled_sign, reached it "
                      "in 1.00 s; PyTorch's best, torch:power_sgd(2), reached it in 1.20 s: "
                      "commopt's best ≤ PyTorch's best: yes (1.2x sooner); "
                      "diloco(8)+scaled_sign against commopt dense: 11.0x sooner to the target.")
  assert "commopt's best ≤ PyTorch's best: no (1.5x later)" in lines[1]
  assert "diloco(8)+scaled_sign against commopt dense: 1.3x later" in lines[1]
  assert "neither reached the target: no verdict" in lines[2]
  table = b.summary_table(s)
  assert "| 4 | 1gbit | commopt best combined | diloco(8)+scaled_sign | 60.0 | 10 | 1.00 |" in table
  assert "| 2 | 1gbit | PyTorch dense | torch:dense | 400.0 | not reached | - |" in table
  # Only commopt's rows go into the per-step verdicts against commopt dense.
  derived = {"4": {"1gbit": {m: dict(r, link_bytes_per_s=None) for m, r in
                             results["4"]["1gbit"].items()}}}
  assert "torch:" not in b.verdicts(derived, ["1gbit"], [4])


@pytest.mark.parametrize("eager", ["eager:diloco(4)+int_quant(4)",
                                   "eager(w=1):diloco(3)+int_quant(4)",
                                   "eager(w=0.5):diloco(5)+int_quant(4)"])   # from an older json
def test_summary_counts_eager_diloco_as_combined(load_script, eager):
  b = load_script(BENCH)
  rows = {"dense": row(0.9, 9.0), "diloco(4)+int_quant(4)": row(0.12, 1.5),
          eager: row(0.05, 0.8), "torch:dense": row(0.8, 8.0)}
  one = b.summarize({"4": {"1gbit": rows}}, ["1gbit"], [4])["4"]["1gbit"]
  assert one["roles"]["commopt best combined"]["method"] == eager
  assert "commopt best compressed" not in one["roles"]     # eager is not a per-step method
  assert one["combined_vs_dense"] == pytest.approx(9.0 / 0.8)


def test_derive_counts_steps_on_the_global_model(load_script):
  b = load_script(BENCH)
  losses = [2.0] * 4 + [0.1] * 12                      # the workers' own models: early
  r = {"step_s": 0.1, "comm_s": 0.01, "sent_bytes": 100.0, "losses": losses,
       "step_times": [5.0] + [0.1] * 15, "period": 8, "global_losses": [[8, 0.9], [16, 0.2]]}
  d = b.derive(r, 2, 0.3)
  # The compiling first step counts as a typical one.
  assert d["steps_to_target"] == 16 and d["time_to_target_s"] == pytest.approx(1.6)
  assert d["link_bytes_per_s"] == pytest.approx(2 * 100.0 / 0.01)
  assert b.derive(r, 2, 0.1)["time_to_target_s"] is None
  # Steps named as compiling (an eager run's outer step and first exchange) count as
  # typical ones; the others as measured.
  eager = dict(r, step_times=[5.0, 0.1, 0.1, 3.0] + [0.1] * 12, compiled_at=[0, 3])
  assert b.derive(eager, 2, 0.3)["time_to_target_s"] == pytest.approx(1.6)
  assert b.derive(dict(eager, compiled_at=[0]), 2, 0.3)["time_to_target_s"] == pytest.approx(4.5)
  # An earlier version's report, with no scores: the smoothed training loss (5 steps).
  assert b.derive(dict(r, period=1, global_losses=[]), 2, 0.3)["steps_to_target"] == 9
  del r["global_losses"]
  assert b.derive(r, 2, 0.3)["steps_to_target"] == 9


@pytest.mark.parametrize("method,short,enough,kind", [
    ("eager:diloco(8)+int_quant(4)", 20, 24, "an eager method"),
    ("diloco(8)+scaled_sign", 12, 16, "a periodic method")])
def test_methods_with_a_period_need_enough_steps(load_script, capsys, method, short, enough, kind):
  """An eager method needs three periods (two compile), a periodic one two (one compiles)."""
  b = load_script(BENCH)
  with pytest.raises(SystemExit):
    b.parse_args(["--methods", f"dense,{method}", "--steps", str(short)])
  assert f"--steps must be at least {enough} with {kind}" in capsys.readouterr().err
  assert b.parse_args(["--methods", method, "--steps", str(enough)]).steps == enough
