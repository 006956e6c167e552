"""Every README and guide example that trains, trained for ten times the steps it shows.

The README's blocks (the tour, the checkpoint section) run as written and in
order, as in ``tests/test_readme.py`` (whose helpers this reuses), with every
training loop ten times as long and each step's loss recorded: the loss must
stay finite and end below where it started. The guide's pages
(``docs/guide/*.md``) have examples of their own (:data:`GUIDE`), some
continuing the README's tour. A transform a page builds without training it
(majority vote, the attacked robust rule, stale workers with a byte budget,
1-bit Adam) trains for ``UNSHOWN_STEPS`` steps, as does a guide example whose
loop shows no count. The sync page's DiLoCo transform also trains an MLP on
fresh minibatches, where Nesterov's outer step over it diverged. Slow tier.
"""
import ast
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
# commopt.launch: the guide test patches it; a submodule, not imported by commopt.
import commopt.launch  # noqa: F401

TESTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from test_readme import README, namespace, python_blocks  # noqa: E402

pytestmark = pytest.mark.slow

FACTOR = 10
"""How many times the steps each example shows it trains for."""

UNSHOWN_STEPS = 100
"""Steps for a transform a page builds but does not train, and for a loop with no count."""

STEP_CALLS = ("step", "my_step", "train")
"""The calls that train: ``dp.step``, ``trainer.step``, the guide's ``my_step`` and its scan."""

# The README's examples that train, by a phrase of their block, and the steps each runs here.
TRAINED = {
    "tour (PowerSGD)": ("commopt.power_sgd(rank=2), axis_name", 20),
    "restored onto 4 workers": ("dp4.step", 1),
}

# A guide page's own example that trains, by page: (the README block it continues, by a
# phrase, or None for a page that sets itself up; the names it leaves to the reader, from
# the README's namespace and a folder; the steps it trains for here).
GUIDE = {
    "data_parallel.md": ("commopt.power_sgd(rank=2), axis_name", lambda ns, folder: {},
                         FACTOR * (10 + 3 + 1)),
    "sync.md": (None, lambda ns, folder: {}, FACTOR * (16 + 16 + 1)),
    "multihost.md": (None, lambda ns, folder: dict(
        first_step=0, steps=UNSHOWN_STEPS, my_rows=lambda step: ns["batch"],
        ckpt_dir=str(folder)), FACTOR * 1 + UNSHOWN_STEPS),
    "from_optax.md": (None, lambda ns, folder: {}, FACTOR * (50 + 50 + 50 + 30)),
    "sharded.md": (None, lambda ns, folder: {}, FACTOR * (30 + 32)),
    "overlap.md": (None, lambda ns, folder: {}, FACTOR * (40 + 40 + 40 + 40)),
    "zero.md": (None, lambda ns, folder: {}, FACTOR * (40 + 40 + 40 + 30 + 30 + 40 + 40)),
    "lowcomm.md": (None, lambda ns, folder: {}, FACTOR * 3 * 100),
}

BY_BLOCK = frozenset({"data_parallel.md", "sync.md"})
"""Pages of independent examples (the README's, once): each block that trains is checked on
its own trace, as the README's blocks are, rather than the page's as one run."""

# Transforms a guide page builds without a loop: (page, phrase of the block, variable,
# local_params).
UNSHOWN = {
    "majority vote": ("methods.md", "majority_vote", "vote", False),
    "trimmed mean under ALIE": ("methods.md", "attacks.attack", "tx", False),
    "stale workers with a byte budget": ("sync.md", "byte_budget", "budgeted", True),
    "1-bit Adam": ("sync.md", "onebit_adam", "tx", False),
}


def _step_call(statement: str):
  """``(losses, per_step, again)`` for a one-line ``... losses = <step>(...)`` statement, else
  None: the name of its losses, whether they hold one value per step (the scan) rather than
  one per worker, and the call made on what it returned (its state arguments replaced by the
  names it assigns)."""
  try:
    tree = ast.parse(statement.strip())
  except SyntaxError:
    return None
  if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign):
    return None
  node = tree.body[0]
  call, targets = node.value, node.targets[0]
  if not (isinstance(call, ast.Call) and isinstance(targets, ast.Tuple)):
    return None
  name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
  last = targets.elts[-1]
  if name not in STEP_CALLS or not (isinstance(last, ast.Name)
                                    and (last.id.endswith("losses") or last.id == "_")):
    return None
  state = targets.elts[:-1]
  again = ast.Assign(targets=[targets], value=ast.Call(
      func=call.func, args=[*state, *call.args[len(state):]], keywords=call.keywords))
  return last.id, name == "train", ast.unparse(ast.fix_missing_locations(again))


def lengthened(block: str, factor: int = FACTOR) -> str:
  """``block`` training ``factor`` times as long, each step's losses handed to ``_record``.

  A ``for _ in range(n)`` loop runs ``factor·n`` times and the scan example's
  stack of ``n`` batches holds ``factor·n``; a step called once at the top
  level is called ``factor`` times, each call after the first on what the
  previous one returned. Steps inside a function (the scan's body) are not
  recorded there; the scan's losses are, one per step.
  """
  out, opened = [], []                   # opened: (indent, keyword) of enclosing blocks
  for line in block.splitlines():
    indent = len(line) - len(line.lstrip())
    if line.strip():
      opened = [(i, k) for i, k in opened if i < indent]
    line = re.sub(r"^(\s*for \w+ in range\()(\d+)(\):)",
                  lambda m: f"{m[1]}{int(m[2]) * factor}{m[3]}", line)
    line = re.sub(r"(jnp\.stack\(\[x\] \* )(\d+)", lambda m: f"{m[1]}{int(m[2]) * factor}", line)
    out.append(line)
    head = line.strip().split(" ")[0]
    if line.rstrip().endswith(":") and head in ("for", "def", "with", "if", "while"):
      opened.append((indent, head))
    found = _step_call(line)
    if found is None or any(k == "def" for _, k in opened):
      continue
    losses, per_step, again = found
    pad = " " * indent
    out.append(f"{pad}_record({losses}, per_step={per_step})")
    if not opened and not per_step:      # a single step at the top level: repeat it
      out += [f"for _ in range({factor - 1}):", f"  {again}",
              f"  _record({losses}, per_step=False)"]
  return "\n".join(out) + "\n"


def _recorder(trace: list):
  def record(losses, per_step):
    values = np.asarray(losses, np.float64)
    trace.extend(values.ravel() if per_step else [values.mean()])
  return record


@pytest.fixture(scope="module")
def run():
  """Runs the README's blocks in order, lengthened: the losses per block."""
  ns = namespace()
  traces = {}
  for i, block in enumerate(python_blocks()):
    trace = []
    ns["_record"] = _recorder(trace)
    exec(compile(lengthened(block), f"{README} (block {i}, lengthened)", "exec"), ns)  # noqa: S102
    traces[i] = trace
  return traces


def _block(phrase: str) -> int:
  found = [i for i, b in enumerate(python_blocks()) if phrase in b]
  assert len(found) == 1, (phrase, found)
  return found[0]


def _decreased(trace):
  trace = np.asarray(trace)
  k = max(1, len(trace) // 10)
  return np.isfinite(trace).all() and trace[-k:].mean() < trace[:k].mean()


def _trains(block: str) -> bool:
  return any(_step_call(line) for line in block.splitlines())


def _guide_blocks(page: pathlib.Path) -> list[str]:
  """A guide page's own Python blocks (the README sections it includes are not in its text)."""
  return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def test_every_example_that_trains_is_checked():
  training = {i for i, b in enumerate(python_blocks()) if _trains(b)}
  assert training == {_block(phrase) for phrase, _ in TRAINED.values()}
  pages = {page.name for page in (TESTS.parent / "docs" / "guide").glob("*.md")
           if any(_trains(b) for b in _guide_blocks(page))}
  assert pages == set(GUIDE)


def test_lengthened_repeats_a_single_step_on_what_it_returned():
  text = lengthened("params, opt_state, losses = dp4.step(restored.params, restored.opt_state, b)")
  assert text.splitlines() == [
      "params, opt_state, losses = dp4.step(restored.params, restored.opt_state, b)",
      "_record(losses, per_step=False)",
      "for _ in range(9):",
      "  params, opt_state, losses = dp4.step(params, opt_state, b)",
      "  _record(losses, per_step=False)"]
  assert "range(160)" in lengthened("for _ in range(16):\n  a, losses = dp.step(a, b)")
  assert "[x] * 100" in lengthened("batches = jax.tree.map(lambda x: jnp.stack([x] * 10), b)")
  assert "_record" not in lengthened("def one(c):\n    p, s, losses = dp.step(*c)\n    return p")


@pytest.mark.parametrize("label", list(TRAINED))
def test_example_trains_for_ten_times_its_steps(label, run):
  traces = run
  phrase, shown = TRAINED[label]
  trace = traces[_block(phrase)]
  assert len(trace) == FACTOR * shown, (label, len(trace))
  assert _decreased(trace), (label, trace[:3], trace[-3:])


def _built(page: str, phrase: str, name: str):
  """``name`` as the page's blocks leave it, run as written up to the one with ``phrase``."""
  ns = namespace()
  for block in _guide_blocks(TESTS.parent / "docs" / "guide" / page):
    exec(compile(block, f"docs/guide/{page}", "exec"), ns)  # noqa: S102
    if phrase in block:
      return ns[name]
  raise AssertionError(f"no block of docs/guide/{page} has {phrase!r}")


@pytest.mark.parametrize("label", list(UNSHOWN))
def test_transform_built_without_a_loop_trains(label):
  page, phrase, name, local_params = UNSHOWN[label]
  ns = namespace()
  dp = commopt.data_parallel(ns["loss_fn"], _built(page, phrase, name),
                             jax.make_mesh((8,), ("data",)), local_params=local_params)
  params, state = dp.place_params(ns["params"]), dp.init(ns["params"])
  trace = []
  for _ in range(UNSHOWN_STEPS):
    params, state, losses = dp.step(params, state, ns["batch"])
    trace.append(float(np.mean(losses)))
  assert _decreased(trace), (label, trace[:3], trace[-3:])


@pytest.mark.parametrize("page", list(GUIDE))
def test_guide_example_trains(page, tmp_path, monkeypatch):
  """A guide page's own example, after the README block it continues, in this one process:
  launching is replaced by a lone process that is never asked to stop (tests/test_launch.py
  checks the stopping)."""
  phrase, names, steps = GUIDE[page]
  ns = namespace()
  if phrase is not None:
    exec(compile(python_blocks()[_block(phrase)], str(README), "exec"), ns)  # noqa: S102
  monkeypatch.setattr(commopt.launch, "initialize", lambda **kw: commopt.launch.Context(0, 1))
  monkeypatch.setattr(commopt.launch, "should_stop", lambda: False)
  ns.update(names(ns, tmp_path))
  traces = []
  for block in _guide_blocks(TESTS.parent / "docs" / "guide" / page):
    traces.append([])
    ns["_record"] = _recorder(traces[-1])
    exec(compile(lengthened(block), f"docs/guide/{page}", "exec"), ns)  # noqa: S102
  trace = [value for block_trace in traces for value in block_trace]
  assert len(trace) == steps, (len(trace), steps)
  if page in BY_BLOCK:
    assert all(_decreased(t) for t in traces if t), [(t[:2], t[-2:]) for t in traces if t]
  else:
    assert _decreased(trace), trace


def test_the_sync_pages_diloco_trains_an_mlp_on_fresh_minibatches():
  """The sync page's DiLoCo transform, as written, under data_parallel on the MLP of
  examples/digits_cnn.py with a fresh minibatch every step, for 600 steps. With Nesterov's
  outer step (0.7, 0.9) over it, its loss rose back to chance (about 2.3)."""
  sys.path.insert(0, str(TESTS.parent / "examples"))
  import digits_cnn

  block = next(b for b in _guide_blocks(TESTS.parent / "docs" / "guide" / "sync.md")
               if "commopt.diloco(" in b)
  statements = [s for s in ast.parse(block).body if isinstance(s, ast.Assign)
                and {getattr(t, "id", None) for t in s.targets} & {"inner", "tx"}]
  ns = {"jax": jax, "jnp": jnp, "optax": optax, "commopt": commopt}
  exec(compile(ast.Module(body=statements, type_ignores=[]), "docs/guide/sync.md",  # noqa: S102
               "exec"), ns)
  x, y = digits_cnn.load_digits_flat()
  params, loss_fn = digits_cnn.mlp_fns(64)
  dp = commopt.data_parallel(loss_fn, ns["tx"], jax.make_mesh((8,), ("data",)), local_params=True)
  local, state = dp.place_params(params), dp.init(params)
  rng = np.random.default_rng(0)
  trace = []
  for _ in range(600):
    rows = rng.integers(0, len(x), size=8 * 32)
    local, state, losses = dp.step(local, state, {"x": x[rows], "y": y[rows]})
    trace.append(float(np.mean(losses)))
  assert _decreased(trace)
  anchor = commopt.transforms.global_params(state)
  assert float(loss_fn(anchor, {"x": x, "y": y})) < 0.05, trace[-10:]
