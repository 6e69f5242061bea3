"""The notebooks of ``notebooks/``, executed so that they are committed with current outputs.

    python -m experiments.report --notebooks

runs each of :data:`NOTEBOOKS` top to bottom in a fresh kernel, from the
repository root, on the committed ``results/`` (``MOEJAX_RESULTS`` unset;
the repository's ``moejax`` first on the path), and writes it back with its
outputs. The outputs are deterministic: no timing metadata is recorded, the
notebooks print no dates or absolute paths, and what they read is the
committed summaries. :func:`text_outputs` is what a test compares between
the committed notebook and a fresh execution (images by count: their bytes
depend on the matplotlib build).

nbclient, nbformat and ipykernel come with the ``test`` extra.
"""

from __future__ import annotations

import os
from typing import Optional

NOTEBOOKS = ("ablation_results", "routing_analysis")
ENV_RESULTS = "MOEJAX_RESULTS"   # a suite directory instead of the committed results/
TEXT_TYPES = ("text/plain", "text/markdown")


def _libs():
  try:
    import nbclient  # pylint: disable=g-import-not-at-top
    import nbformat  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise SystemExit(f"error: executing the notebooks needs nbclient and nbformat ({e}); "
                     "fix: pip install -e '.[test]'") from e
  return nbclient, nbformat


def path_of(root: str, name: str) -> str:
  return os.path.join(root, "notebooks", f"{name}.ipynb")


def execute(root: str, name: str, suite_dir: Optional[str] = None, timeout: int = 600):
  """The executed notebook ``name`` (nbformat node): on ``suite_dir`` when given, else on the
  committed ``results/`` of ``root``."""
  nbclient, nbformat = _libs()
  nb = nbformat.read(path_of(root, name), as_version=4)
  env = {k: v for k, v in os.environ.items() if k != ENV_RESULTS}
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
  if suite_dir:
    env[ENV_RESULTS] = suite_dir
  client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                   record_timing=False,
                                   resources={"metadata": {"path": root}})
  client.execute(env=env)
  return nb


def text_outputs(nb) -> list[list]:
  """Per code cell: its stream texts, text results and the number of its images."""
  cells = []
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    got, pngs = [], 0
    for o in cell.outputs:
      if o.output_type == "stream":
        got.append((o.name, o.text))
      elif o.output_type == "error":
        got.append(("error", f"{o.ename}: {o.evalue}"))
      else:
        data = o.get("data", {})
        got += [(t, data[t]) for t in TEXT_TYPES if t in data]
        pngs += "image/png" in data
    cells.append([got, pngs])
  return cells


def refresh(root: str) -> list[str]:
  """Executes every notebook on the committed results and writes it back with its outputs."""
  nbclient, nbformat = _libs()
  out = []
  for name in NOTEBOOKS:
    try:
      nb = execute(root, name)
    except nbclient.exceptions.CellExecutionError as e:  # nothing written: the old file stays
      raise SystemExit(f"error: notebooks/{name}.ipynb: a cell raised {e.ename}: {e.evalue}; "
                       "fix the cell (or the summaries it reads) and run again") from e
    nbformat.write(nb, path_of(root, name))
    out.append(path_of(root, name))
  return out
