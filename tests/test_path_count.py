"""benchmarks/path_count.py: what it counts while one step is lowered (not its targets,
which the script itself checks)."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "path_count.py"

# Two functions in two commopt modules (by their globals' __name__) and one elsewhere.
SOURCES = {
    "commopt.fake_a": "def outer(inner):\n  return inner() + inner()\n",
    "commopt.fake_b": "def leaf():\n  return 1\n",
    "somebody_else": "def via(f):\n  return f()\n",
}


def _functions():
  spaces = {}
  for name, source in SOURCES.items():
    spaces[name] = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), spaces[name])
  return spaces["commopt.fake_a"]["outer"], spaces["commopt.fake_b"]["leaf"], \
      spaces["somebody_else"]["via"]


def test_a_switch_is_a_call_into_another_commopt_module_than_the_call_before(load_script):
  module = load_script(SCRIPT)
  outer, leaf, via = _functions()
  with module.PathCounter() as counter:
    outer(lambda: via(leaf))
    outer(leaf)
  result = counter.result()
  # Calls into commopt, in order: a, b, b (through the lambda and `via`), a, b, b.
  assert result["by_module"] == {"commopt.fake_b": 4, "commopt.fake_a": 2}
  assert (result["calls"], result["modules"], result["switches"]) == (6, 2, 3)


def test_the_step_lowering_is_counted(load_script, tmp_path):
  module = load_script(SCRIPT)
  result = module.count()
  assert result["calls"] > 0 and result["switches"] > 0
  assert result["modules"] == len(result["by_module"]) > 0
  assert result["calls"] == sum(result["by_module"].values())
  assert "commopt.transforms._compressed_mean" in result["by_module"]
  assert all(m == "commopt" or m.startswith("commopt.") for m in result["by_module"])
  counts = list(result["by_module"].values())
  assert counts == sorted(counts, reverse=True)
  assert module.missed({**result, "modules": 17, "switches": 300}) == ["modules: 17 > 16"]
  assert "modules entered, by calls:" in module.table(result)
  assert json.loads(json.dumps(result)) == result   # what --json writes
