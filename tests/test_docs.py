"""Every method cites its paper, and every citation has an entry in docs/references.bib;
the guide pages that hold the README's longer examples run them (:data:`PAGES`)."""

import inspect
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import commopt
import commopt.launch  # noqa: F401  (a submodule commopt does not import; the tests patch it)
from commopt.aggregators import attacks

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_readme import namespace, python_blocks  # noqa: E402
BIB = ROOT / "docs" / "references.bib"

# Public functions that are utilities, not methods from a paper.
UTILITIES = {
    "identity", "make", "options", "register", "unregister", "qsgd_coded_bits",
    "qsgd_elias_bits", "budget_top_k", "compresses", "fragment_of", "global_params",
    "is_sync_step", "sync_levels", "warmup_density", "vote_words", "alie_z",
    "byzantine_mask", "apply_if_finite", "multi_steps",
}


def public_functions():
  for mod in (commopt.compressors, commopt.transforms, commopt.aggregators, attacks):
    for name in mod.__all__:
      obj = getattr(mod, name)
      if inspect.isfunction(obj) and name not in UTILITIES:
        yield f"{mod.__name__}.{name}", obj


def citations(doc):
  """(first author's surname, year) of each entry of a docstring's References section."""
  match = re.search(r"^References:\n((?:(?:[ \t]+\S.*)?\n?)+)", doc, re.M)
  if not match:
    return []
  # An entry runs over one or more lines and ends with a full stop.
  entries, current = [], []
  for line in match.group(1).splitlines():
    if not line.strip():
      break
    current.append(line.strip())
    if line.rstrip().endswith("."):
      entries.append(current)
      current = []
  entries += [current] if current else []
  out = []
  for entry in (" ".join(e) for e in entries):
    if entry.startswith("``"):                 # a library's behaviour, not a paper
      continue
    author = re.match(r"([^\s,&]+)", entry).group(1)
    years = re.findall(r"\b(1[89]\d\d|20\d\d)\b", entry)
    out.append((author, years[-1] if years else None, entry))
  return out


def bib_entries():
  text = BIB.read_text()
  entries = {}
  for key, body in re.findall(r"@\w+\{(\w+),(.*?)\n\}", text, re.S):
    author = re.search(r"author\s*=\s*\{(.*?)\},\n", body, re.S).group(1)
    year = re.search(r"year\s*=\s*\{(\d{4})\}", body).group(1)
    surname = author.split(",")[0].strip()
    for tex, char in (("{\\'a}", "á"), ("{\\'e}", "é"), ("{\\'i}", "í")):
      surname = surname.replace(tex, char)
    surname = surname.strip("{}")
    entries[key] = (surname, year)
  return entries


def test_bibtex_is_well_formed_and_keys_are_unique():
  text = BIB.read_text()
  keys = re.findall(r"@\w+\{(\w+),", text)
  assert len(keys) == len(set(keys)) and len(keys) == len(bib_entries()) >= 40
  assert text.count("{") == text.count("}")


@pytest.mark.parametrize("name,fn", list(public_functions()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_method_cites_a_paper_listed_in_the_bibliography(name, fn):
  cited = citations(inspect.getdoc(fn) or "")
  assert cited, f"{name} has no References section"
  listed = set(bib_entries().values())
  for author, year, entry in cited:
    if entry.startswith("``"):
      continue
    assert (author, year) in listed, f"{name} cites {entry!r}: no {author} {year} in {BIB.name}"


def test_every_registered_compressor_but_identity_cites_a_paper():
  for name, factory in commopt.compressors.REGISTRY.items():
    if name != "identity":
      assert citations(inspect.getdoc(factory) or ""), name


def test_the_references_page_includes_the_bibliography():
  page = (ROOT / "docs" / "references.md").read_text()
  assert '--8<-- "docs/references.bib"' in page


# --- The guide pages that took the README's longer examples: their Python blocks run ---

GUIDE = ROOT / "docs" / "guide"
PAGES = {
    "methods.md": None,
    "data_parallel.md": "commopt.power_sgd(rank=2), axis_name",
    "sync.md": None,
    "multihost.md": None,
    "measuring.md": None,
}
"""Each page whose examples run here, with the README block it continues (by a phrase of
it: the tour's step, model and batch) or None where the page sets itself up from the
README's namespace (a ``loss_fn``, its ``params`` and a ``batch``)."""


def page_blocks(page: str) -> list[str]:
  return re.findall(r"^```python\n(.*?)^```", (GUIDE / page).read_text(), flags=re.S | re.M)


def test_the_guide_pages_have_the_examples_the_readme_had():
  text = {page: "\n".join(page_blocks(page)) for page in PAGES}
  for phrase in ("majority_vote", "attacks.attack", "checks.run_all", "comm_plan"):
    assert phrase in text["methods.md"], phrase
  for phrase in ("jax.lax.scan", "nnx_data_parallel", "local_value_and_grad"):
    assert phrase in text["data_parallel.md"], phrase
  for phrase in ("commopt.diloco(", "period={", "byte_budget", "onebit_adam", "sfb_mean"):
    assert phrase in text["sync.md"], phrase
  assert "launch.initialize()" in text["multihost.md"]
  assert "network.predict" in text["measuring.md"]
  for phrase in PAGES.values():
    assert phrase is None or sum(phrase in b for b in python_blocks()) == 1, phrase


def _run_page(page, monkeypatch, tmp_path, capsys):
  """The page's blocks in order, after the README block it continues: the namespace."""
  ns = namespace()
  phrase = PAGES[page]
  if phrase is not None:
    block = next(b for b in python_blocks() if phrase in b)
    exec(compile(block, "README.md", "exec"), ns)  # noqa: S102 - the README's own code
  # Launching is a lone process, asked to stop at its first poll (tests/test_launch.py
  # checks the real thing); the names the multi-host page leaves to its reader.
  monkeypatch.setattr(commopt.launch, "initialize", lambda **kw: commopt.launch.Context(0, 1))
  monkeypatch.setattr(commopt.launch, "should_stop", lambda: True)
  ns.update(first_step=0, steps=3, ckpt_dir=str(tmp_path))
  for block in page_blocks(page):
    exec(compile(block, f"docs/guide/{page}", "exec"), ns)  # noqa: S102 - the page's code
  return ns, capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("page", list(PAGES))
def test_a_guide_pages_blocks_run_in_order(page, monkeypatch, tmp_path, capsys):
  ns, printed = _run_page(page, monkeypatch, tmp_path, capsys)
  for name in ("losses", "wide_losses"):
    if name in ns:
      assert np.isfinite(np.asarray(ns[name])).all(), (page, name)
  if page == "data_parallel.md":
    assert int(ns["opt_state"].total_notfinite) == 0
    # The nnx model was trained: its batch statistics moved from their initial zeros.
    assert np.abs(np.asarray(ns["model"].bn.mean[...])).max() > 0
  if page == "sync.md":
    assert "synchronisations;" in printed and "<= 2000 bytes per step" in printed
  if page == "methods.md":
    assert ns["ran"] and ns["plan"].collectives   # the suite ran; the plan has its collectives
  if page == "multihost.md":
    assert (tmp_path / "step_1").is_dir()     # saved when asked to stop, at the first step
  if page == "measuring.md":
    assert ns["p"].comm_s < ns["p"].dense_comm_s


@pytest.mark.parametrize("name", ["vote", "tx"])
def test_the_methods_pages_fragments_train_under_data_parallel(name):
  """The majority-vote and attacked robust chains of the methods page train a regression."""
  ns = namespace()
  fragments = [b for b in page_blocks("methods.md")
               if "majority_vote" in b or "attacks.attack" in b]
  exec(compile("import jax, optax, commopt\n" + "\n".join(fragments), "methods.md",  # noqa: S102
               "exec"), ns)
  tx = ns[name]
  if name == "vote":
    tx = optax.chain(tx, optax.scale(1e2))   # steps of 0.1 rather than the page's 1e-3
  dp = commopt.data_parallel(ns["loss_fn"], tx, jax.make_mesh((8,), ("data",)))
  params, state = ns["params"], dp.init(ns["params"])
  first = None
  for _ in range(60):
    params, state, losses = dp.step(params, state, ns["batch"])
    first = float(losses.mean()) if first is None else first
  assert float(losses.mean()) < 0.5 * first
  assert jnp.isfinite(losses).all()
