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


def module_name(path: pathlib.Path) -> str:
  """``commopt/x/y.py`` is ``commopt.x.y``; ``commopt/x/__init__.py`` is ``commopt.x``."""
  parts = ("commopt",) + path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
  """Whether ``node`` is ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
  return (isinstance(node, ast.If)
          and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"))


def _import_nodes(nodes):
  """Every import statement in or under ``nodes``, those inside functions and classes
  included, those under ``if TYPE_CHECKING:`` left out (a docstring's examples are strings,
  not code)."""
  for node in nodes:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    elif _type_checking(node):
      yield from _import_nodes(node.orelse)
    else:
      yield from _import_nodes(ast.iter_child_nodes(node))


def imported_modules(source: str, name: str, is_package: bool, modules) -> set:
  """``{(commopt module, line)}`` that module ``name``'s ``source`` imports: ``from a.b import
  c`` is module ``a.b.c`` when that is one of ``modules``, else ``a.b``; relative imports are
  resolved against ``name``'s package."""
  package = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in _import_nodes(ast.parse(source).body):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    else:
      base = node.module or ""
      if node.level:
        anchor = package.rsplit(".", node.level - 1)[0]
        base = f"{anchor}.{base}" if base else anchor
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names]
    found |= {(t, node.lineno) for t in targets if t in modules and t != name}
  return found


def import_graph() -> dict:
  """``{module: {imported module: first line}}`` over every module of ``commopt/``."""
  files = {module_name(p): p for p in sources()}
  graph = {}
  for name, path in files.items():
    edges = {}
    for target, line in sorted(imported_modules(path.read_text(), name,
                                                path.name == "__init__.py", files)):
      edges.setdefault(target, line)
    graph[name] = edges
  return graph


def import_cycles(graph: dict) -> list[list[str]]:
  """The strongly connected components of ``graph`` with more than one module (Tarjan's
  algorithm): each is a set of modules that import one another, directly or not."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(found)


def test_no_import_cycle():
  """No module of ``commopt/`` imports, directly or through others, a module that imports it
  back, counting imports made inside functions (deferred ones) too."""
  graph = import_graph()
  cycles = import_cycles(graph)
  report = []
  for component in cycles:
    members = set(component)
    edges = [f"    {a} -> {b} (line {line})" for a in component
             for b, line in sorted(graph[a].items()) if b in members]
    report.append(f"{len(component)} modules: {', '.join(component)}\n" + "\n".join(edges))
  assert not cycles, "import cycles:\n" + "\n".join(report)


def test_the_cycle_check_would_catch_a_deferred_import():
  modules = {"commopt.a", "commopt.b", "commopt.c", "commopt.p", "commopt.p.m"}
  deferred = "def f():\n  from commopt import b\n"
  assert imported_modules(deferred, "commopt.a", False, modules) == {("commopt.b", 2)}
  typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from commopt import b\n"
  assert imported_modules(typed, "commopt.a", False, modules) == set()
  relative = "from . import m\nfrom .m import thing\nfrom .. import c\n"
  assert imported_modules(relative, "commopt.p", True, modules) == {
      ("commopt.p.m", 1), ("commopt.p.m", 2), ("commopt.c", 3)}
  graph = {"commopt.a": {"commopt.b": 1}, "commopt.b": {"commopt.c": 1},
           "commopt.c": {"commopt.a": 2}, "commopt.p": {"commopt.p.m": 1},
           "commopt.p.m": {}}
  assert import_cycles(graph) == [["commopt.a", "commopt.b", "commopt.c"]]


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
  """A top-level name takes an optax name only as a drop-in replacement (the same call,
  made to agree across workers), or as the subpackage of that name."""
  import optax
  same_meaning = {"apply_if_finite", "transforms"}
  clash = {n for n in commopt.__all__ if hasattr(optax, n)
           and getattr(optax, n) is not getattr(commopt, n)}
  assert clash == same_meaning, clash ^ same_meaning


def test_the_top_level_is_a_sorted_core_of_at_most_50_names():
  assert commopt.__all__ == sorted(commopt.__all__, key=str.lower)
  assert len(commopt.__all__) <= 50
  import types
  # Besides the core: subpackages imported on first use (commopt.checkpoint, ...).
  public = {n for n in dir(commopt) if not n.startswith("_")
            and not isinstance(getattr(commopt, n), types.ModuleType)} - {"MOVED", "annotations"}
  assert public <= set(commopt.__all__), public - set(commopt.__all__)
  for name in commopt.__all__:
    assert getattr(commopt, name) is not None, name


MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 150


def test_no_module_or_function_outgrows_one_concept():
  """A module holds one concept, whatever its length: the ceiling of 900 lines only catches
  one that has grown several; no function over 150 lines (docstrings included): past that,
  it holds several steps."""
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


def test_at_most_three_context_variables_each_saying_why():
  """Transforms cooperate through their arguments, outputs and state: a context variable is
  for a setting of the whole trace, each with a comment above it saying why it is not an
  argument."""
  found = []
  for path in sources():
    lines = path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and ast.unparse(node.func) == "contextvars.ContextVar":
        above = lines[node.lineno - 2].strip()
        found.append((f"{path.relative_to(ROOT)}:{node.lineno}", above.startswith("#")))
  assert 1 <= len(found) <= 3, found
  assert all(commented for _, commented in found), found
