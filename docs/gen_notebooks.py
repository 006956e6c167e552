"""Renders every jupytext notebook in examples/notebooks as a page of the docs site.

Run by mkdocs-gen-files during ``mkdocs build``: prose cells become Markdown,
code cells Python blocks. The notebooks are not executed here (the test suite
runs them in small mode); each page says how to run it in full.
"""

import pathlib

import jupytext
import mkdocs_gen_files

ROOT = pathlib.Path(__file__).resolve().parents[1]

for path in sorted((ROOT / "examples" / "notebooks").glob("*.py")):
  notebook = jupytext.read(path)
  notebook.metadata = {}
  body = jupytext.writes(notebook, fmt="md")
  rel = path.relative_to(ROOT).as_posix()
  run = (f"\n!!! note \"Run it\"\n    `python {rel}` runs it in full and writes its plots to "
         f"`runs/notebooks/` (`COMMOPT_NOTEBOOK_OUT` to change; `COMMOPT_NOTEBOOK_SMALL=1` "
         f"for the quick version the tests run); `jupytext --to ipynb {rel}` makes a "
         f"Jupyter notebook of it.\n")
  head, _, rest = body.partition("\n")           # the title line first, then the note
  with mkdocs_gen_files.open(f"notebooks/{path.stem}.md", "w") as out:
    out.write(head + "\n" + run + rest)
  mkdocs_gen_files.set_edit_path(f"notebooks/{path.stem}.md", f"../{rel}")
