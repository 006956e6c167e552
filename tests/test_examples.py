"""The demo and the benchmark run end to end (shortened)."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(args, tmp_path):
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_demo_trains_and_plots(tmp_path):
  out = run(["examples/train.py", "--compressors", "identity,scaled_sign", "--epochs", "1",
             "--max-steps", "4", "--workers", "4", "--out", str(tmp_path)], tmp_path)
  assert "HLO audit" in out and "test acc" in out
  metrics = json.loads((tmp_path / "train_metrics.json").read_text())
  assert set(metrics) == {"identity", "scaled_sign"}
  sign = metrics["scaled_sign"]
  # The audit holds the payload, the batch statistics' mean and the skip flag.
  assert sign["audited_bytes"] == (sign["payload_bytes"] + sign["model_state_sync_bytes"]
                                   + sign["skip_flag_bytes"])
  assert sign["model_state_sync_bytes"] == 2 * 64 * 4 and sign["skipped_steps"] == 0
  assert sign["dense_bytes"] / sign["payload_bytes"] > 30
  assert (tmp_path / "train_loss_vs_bytes.png").stat().st_size > 10_000


def test_demo_runs_quantizers_and_signum(tmp_path):
  out = run(["examples/train.py", "--compressors", "qsgd,int_quant,signum", "--epochs", "1",
             "--max-steps", "2", "--workers", "2", "--bits", "4", "--levels", "3",
             "--out", str(tmp_path)], tmp_path)
  assert "Elias coding" in out
  metrics = json.loads((tmp_path / "train_metrics.json").read_text())
  assert metrics["int_quant"]["compressor"].startswith("int_quant(bits=4")
  assert metrics["qsgd"]["compressor"].startswith("qsgd(levels=3")
  for h in metrics.values():
    assert h["audited_bytes"] == (h["payload_bytes"] + h["model_state_sync_bytes"]
                                  + h["skip_flag_bytes"])
  assert metrics["signum"]["dense_bytes"] / metrics["signum"]["payload_bytes"] > 30


# A short demo run: two epochs of three steps on 4 workers, one compressor.
SHORT = ["examples/train.py", "--compressors", "scaled_sign", "--workers", "4",
         "--steps-per-epoch", "3"]


def metrics(out):
  return json.loads((out / "train_metrics.json").read_text())["scaled_sign"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """Two epochs in one process, without checkpoints: the reference."""
  out = tmp_path_factory.mktemp("uninterrupted")
  run([*SHORT, "--epochs", "2", "--out", str(out)], out)
  return metrics(out)


def test_demo_two_processes_match_one(uninterrupted, tmp_path):
  out = run([*SHORT, "--epochs", "2", "--processes", "2", "--out", str(tmp_path)], tmp_path)
  assert "4 workers in 2 processes" in out and "HLO audit" in out and "[Gloo]" not in out
  got = metrics(tmp_path)
  assert got["step"] == uninterrupted["step"] == list(range(1, 7))
  # The batch statistics' mean adds across processes in another order: float rounding.
  np.testing.assert_allclose(got["loss"], uninterrupted["loss"], rtol=1e-5, atol=1e-6)
  assert got["audited_bytes"] == uninterrupted["audited_bytes"]
  assert got["bytes_sent"] == uninterrupted["bytes_sent"]


def test_demo_resumes_as_if_never_stopped(uninterrupted, tmp_path):
  ckpt = str(tmp_path / "ckpt")
  run([*SHORT, "--epochs", "1", "--checkpoint-dir", ckpt, "--out", str(tmp_path / "a")],
      tmp_path)
  saved = json.loads((tmp_path / "ckpt" / "scaled_sign" / "progress.json").read_text())
  assert (saved["epochs_done"], saved["step"], saved["checkpoint"]) == (1, 3, "step_00000003")
  out = run([*SHORT, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume",
             "--out", str(tmp_path / "b")], tmp_path)
  assert "resumed from" in out and "epoch   1" not in out
  resumed = metrics(tmp_path / "b")
  # Restored onto the same workers, with the same data order and dropout keys: bit for bit.
  for key in ("step", "loss", "bytes_sent", "epoch_loss", "epoch_acc"):
    assert resumed[key] == uninterrupted[key], key
  assert sorted(p.name for p in (tmp_path / "ckpt" / "scaled_sign").iterdir()) == [
      "progress.json", "step_00000006"]                  # only the latest checkpoint is kept
  out = run([*SHORT, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume",
             "--out", str(tmp_path / "c")], tmp_path)
  assert "already trained (2 epochs, 6 steps)" in out
  assert metrics(tmp_path / "c")["loss"] == uninterrupted["loss"]


SYNC = ["examples/train.py", "--sync", "diloco", "--period", "2", "--compressors",
        "identity,top_k", "--workers", "4", "--steps-per-epoch", "3"]


def test_demo_synchronises_less_often_and_resumes(tmp_path):
  whole = tmp_path / "whole"
  out = run([*SYNC, "--epochs", "2", "--out", str(whole)], tmp_path)
  assert "diloco(H=2) dense" in out and "each exchange in a cond" in out
  got = json.loads((whole / "train_metrics.json").read_text())
  for name, h in got.items():
    # Bytes grow by the exchange on steps 2, 4, 6 only; every step all-reduces
    # the batch statistics and the skip flag, the same few bytes.
    per_step = np.diff([0.0] + h["bytes_sent"])
    small, big = per_step[0::2], per_step[1::2]
    assert np.all(small == small[0]) and np.all(big == big[0]), (name, per_step)
    assert big[0] - small[0] > 100 * small[0], (name, per_step)
    assert 0 < h["epoch_acc"][-1] <= 1
  assert got["identity"]["bytes_sent"][-1] > 20 * got["top_k"]["bytes_sent"][-1]
  # Stopped after an epoch and resumed: the per-worker parameters, anchor and
  # residuals come back bit for bit.
  ckpt = str(tmp_path / "ckpt")
  run([*SYNC, "--epochs", "1", "--checkpoint-dir", ckpt, "--out", str(tmp_path / "a")], tmp_path)
  out = run([*SYNC, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume",
             "--out", str(tmp_path / "b")], tmp_path)
  assert "resumed from" in out
  resumed = json.loads((tmp_path / "b" / "train_metrics.json").read_text())
  for name in got:
    for key in ("loss", "bytes_sent", "epoch_acc"):
      assert resumed[name][key] == got[name][key], (name, key)


def test_demo_runs_stale_with_a_byte_budget(tmp_path):
  out = run(["examples/train.py", "--sync", "stale", "--staleness", "2", "--byte-budget",
             "20000", "--compressors", "identity", "--workers", "4", "--epochs", "1",
             "--max-steps", "3", "--out", str(tmp_path)], tmp_path)
  h = json.loads((tmp_path / "train_metrics.json").read_text())["identity"]
  assert h["compressor"] == "stale(s=2, 20000 B/step) dense"
  assert 20000 - 8 * 20 <= h["payload_bytes"] <= 20000


def test_demo_runs_onebit_adam(tmp_path):
  out = run(["examples/train.py", "--compressors", "onebit_adam", "--freeze-step", "2",
             "--workers", "4", "--epochs", "1", "--max-steps", "5", "--out", str(tmp_path)],
            tmp_path)
  assert "the first 2 steps all-reduce" in out
  h = json.loads((tmp_path / "train_metrics.json").read_text())["onebit_adam"]
  per_step = np.diff([0.0] + h["bytes_sent"])
  # Two dense warm-up steps, then the 1-bit momentum: far fewer bytes.
  assert per_step[0] == per_step[1] and np.all(per_step[2:] == per_step[2])
  assert per_step[0] > 15 * per_step[2], per_step
  assert np.isfinite(h["loss"]).all()


def test_demo_runs_zero_one_adam_and_onebit_lamb(tmp_path):
  run(["examples/train.py", "--compressors", "zero_one_adam,onebit_lamb", "--freeze-step", "2",
       "--local-step-scaler", "1", "--workers", "4", "--epochs", "1", "--max-steps", "8",
       "--out", str(tmp_path)], tmp_path)
  runs = json.loads((tmp_path / "train_metrics.json").read_text())
  for name in ("zero_one_adam", "onebit_lamb"):
    assert np.isfinite(runs[name]["loss"]).all(), name
  # 0/1 Adam skips rounds after the freeze: those steps send only the batch
  # statistics, less than a 1-bit round, itself far less than a dense step.
  per_step = np.diff([0.0] + runs["zero_one_adam"]["bytes_sent"])
  rounds = sorted(set(per_step[2:]))
  assert len(rounds) == 2 and rounds[0] < rounds[1] < per_step[0] / 15, per_step


def test_demo_sends_sufficient_factors(tmp_path):
  out = run(["examples/train.py", "--compressors", "identity", "--sfb", "--workers", "4",
             "--epochs", "1", "--max-steps", "3", "--out", str(tmp_path)], tmp_path)
  assert "sfb + identity" in out
  h = json.loads((tmp_path / "train_metrics.json").read_text())["identity"]
  # fc1 (4096 x 256) goes as 32 rows of factors per worker: far fewer bytes than dense.
  assert np.isfinite(h["loss"]).all()
  assert "x smaller" in out and "HLO audit" in out


@pytest.mark.parametrize("args, message", [
    (["--sfb", "--sync", "diloco"], "--sfb sends the dense layers' factors every step"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--sync", "diloco", "--compressors", "signum"],
     "--sync diloco: ['signum'] reduce every step by their own rule"),
    (["--byte-budget", "1000"], "--byte-budget 1000 is for --sync stale with --compressors "
                                "identity"),
    (["--workers", "5", "--processes", "2"],
     "--workers 5 is not divisible by --processes 2"),
])
def test_demo_rejects_bad_flag_combinations(args, message):
  proc = subprocess.run([sys.executable, "examples/train.py", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_demo_refuses_to_overwrite_or_change_a_saved_run(tmp_path):
  ckpt = tmp_path / "ckpt" / "scaled_sign"
  ckpt.mkdir(parents=True)
  (ckpt / "progress.json").write_text(json.dumps(
      {"step": 3, "epochs_done": 1, "checkpoint": "step_00000003",
       "config": {"lr": 0.1}}))
  for extra, message in (([], "already holds a scaled_sign run (step 3); pass --resume"),
                         (["--resume"], "was saved with --lr 0.1, this run has --lr 0.05")):
    proc = subprocess.run([sys.executable, *SHORT, "--checkpoint-dir", str(tmp_path / "ckpt"),
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_demo_rejects_unknown_compressor(tmp_path):
  proc = subprocess.run([sys.executable, "examples/train.py", "--compressors", "sgn"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "unknown 'sgn'" in proc.stderr


def test_benchmark_reports_ratios(tmp_path):
  out = run(["benchmarks/bench_foundation.py", "--workers", "2", "--steps", "2",
             "--compressors", "power_sgd,scaled_sign", "--strategies", "auto,two_phase",
             "--out", str(tmp_path)], tmp_path)
  assert "time vs dense" in out
  assert "skipped power_sgd(rank=2) with strategy='two_phase'" in out
  rows = json.loads((tmp_path / "foundation.json").read_text())["rows"]
  assert [r["compressor"] for r in rows] == [
      "identity", "power_sgd(rank=2)", "scaled_sign", "scaled_sign [two_phase]"]
  assert rows[0]["step_time_vs_dense"] == 1.0
  assert rows[1]["audited_bytes"] == rows[1]["payload_bytes"] < rows[0]["payload_bytes"]
  assert rows[3]["sent_bytes"] < rows[2]["sent_bytes"] * 1.5   # two workers: about even


def test_quantize_benchmark_puts_baselines_beside(tmp_path):
  run(["benchmarks/bench_quantize.py", "--sizes", "4096", "--repeats", "1",
       "--compressors", "scaled_sign,qsgd", "--out", str(tmp_path)], tmp_path)
  rows = json.loads((tmp_path / "quantize.json").read_text())["rows"]
  methods = [r["method"] for r in rows]
  assert methods[0].startswith("copy") and "peer: numpy packbits sign" in methods
  sign = next(r for r in rows if r["method"] == "scaled_sign")
  assert sign["vs_peer"] is not None and sign["vs_copy"] > 0
