"""Every method cites its paper, and every citation has an entry in docs/references.bib."""

import inspect
import pathlib
import re

import pytest

import commopt
from commopt.aggregators import attacks

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("name,fn", list(public_functions()), ids=lambda v: v if isinstance(v, str) else "")
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
