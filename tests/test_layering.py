"""The package's layering, as stated in ``commopt/__init__.py``, holds in its imports."""

import ast
import re
import pathlib

import commopt

ROOT = pathlib.Path(commopt.__file__).parent
COLLECTIVES = {"psum", "pmean", "pmax", "pmin", "psum_scatter", "all_gather",
               "all_gather_invariant", "all_to_all", "ppermute", "pshuffle", "pbroadcast",
               "ragged_all_to_all", "axis_index", "axis_size"}


def collective_calls(source: str):
  """Lines of ``source`` that reach a ``jax.lax`` collective, by name or by import."""
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Attribute) and node.attr in COLLECTIVES
        and ast.unparse(node.value).split(".")[-1] == "lax"):
      yield node.lineno
    elif (isinstance(node, ast.ImportFrom) and node.module == "jax.lax"
          and any(a.name in COLLECTIVES for a in node.names)):
      yield node.lineno


def layers() -> dict[str, int]:
  """``{subpackage or module: rank}`` from the docstring's "Layers, lowest first:" line."""
  line = next(l for l in commopt.__doc__.splitlines() if l.startswith("Layers, lowest first:"))
  ranks = {}
  for rank, group in enumerate(line.split(":", 1)[1].split("<")):
    for name in group.split(","):
      ranks[name.strip()] = rank
  return ranks


def sources():
  return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def unit(path: pathlib.Path) -> str:
  """The layer a file belongs to: its subpackage, or the top-level module's name."""
  rel = path.relative_to(ROOT).parts
  return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def imported_units(path: pathlib.Path):
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    targets = {n.split(".")[1] for n in names if n.startswith("commopt.")}
    for target in sorted(targets):
      yield node.lineno, target


def test_the_stated_layers_cover_every_subpackage_and_module():
  ranks = layers()
  units = {unit(p) for p in sources()} - {"__init__"}
  assert units == set(ranks), (units ^ set(ranks))


def test_no_module_imports_from_a_layer_above_its_own():
  ranks = layers()
  bad = []
  for path in sources():
    own = unit(path)
    if own == "__init__":
      continue
    for line, target in imported_units(path):
      if target in ranks and ranks[target] > ranks[own]:
        bad.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports commopt.{target}")
  assert not bad, "\n".join(bad)


def test_only_comm_calls_collectives():
  """Every module outside ``comm/`` (``_src/``, the kernels and the compressors included)."""
  hits = []
  for path in sources():
    if unit(path) == "comm":
      continue
    text = path.read_text()
    for line in collective_calls(text):
      hits.append(f"{path.relative_to(ROOT)}:{line}: {text.splitlines()[line - 1].strip()}")
  assert not hits, "\n".join(hits)


def test_the_collectives_check_would_catch_a_direct_call():
  assert list(collective_calls("y = jax.lax.psum(x, 'data')")) == [1]
  assert list(collective_calls("from jax import lax\ny = lax.all_to_all(x, 'd', 0, 0)")) == [2]
  assert list(collective_calls("from jax.lax import all_gather")) == [1]
  assert not list(collective_calls("y = jax.lax.pcast(x, 'data', to='varying')  # not psum"))


def test_no_top_level_name_shadows_optax_with_another_meaning():
  import optax
  # Same meaning, made to agree across workers (an axis_name argument), and the
  # subpackage of that name.
  same_meaning = {"apply_if_finite", "ApplyIfFiniteState", "MultiStepsState", "transforms"}
  clash = {n for n in commopt.__all__ if hasattr(optax, n)
           and getattr(optax, n) is not getattr(commopt, n)}
  assert clash == same_meaning, clash ^ same_meaning


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 150


def test_no_module_or_function_outgrows_one_concept():
  """No module of ``commopt/`` over 600 lines and no function over 150 (docstrings included):
  past that, a module holds several concepts and a function several steps."""
  big = []
  for path in sources():
    text = path.read_text()
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
      big.append(f"{path.relative_to(ROOT)}: {lines} lines")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES:
          big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
  assert not big, "\n".join(big)


def test_a_removed_public_name_says_where_it_went():
  import pytest
  for name, (home, _) in commopt.MOVED.items():
    with pytest.raises(AttributeError, match=f"commopt.{name} moved to {re.escape(home)}"):
      getattr(commopt, name)
  with pytest.raises(AttributeError, match="encode_tree"):
    commopt.compressors.GlobalCompressor   # noqa: B018
  assert commopt.compressors.identity().name == "identity"
  changelog = (ROOT.parent / "CHANGELOG.md").read_text()
  for name in commopt.MOVED:
    assert f"`commopt.{name}`" in changelog, name
