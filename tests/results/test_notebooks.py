"""The notebooks run top to bottom on the committed results/ (their default) and on a suite
directory (the tiny suite here); they are committed executed, with the outputs a fresh
execution gives; the routing notebook's numbers are the summary's."""

from __future__ import annotations

import json
import os
import re

import nbformat
import pytest

from moejax.results import notebooks
from tests.ablation import helpers


def _check_ran(nb):
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert [o for o in outputs if "image/png" in o.get("data", {})]  # the plots were drawn
  return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_committed_notebook_outputs_are_those_of_a_fresh_execution(name):
  committed = nbformat.read(notebooks.path_of(helpers.ROOT, name), as_version=4)
  want = notebooks.text_outputs(committed)
  assert any(texts or pngs for texts, pngs in want), f"{name}: committed without outputs"
  fresh = notebooks.execute(helpers.ROOT, name)
  text = _check_ran(fresh)
  assert notebooks.text_outputs(fresh) == want, (
      f"notebooks/{name}.ipynb: its committed outputs are not what results/ gives now. "
      "Fix: python -m experiments.report --notebooks")
  # Deterministic and portable: no absolute paths (tmp dirs, this checkout) in the outputs.
  assert helpers.ROOT not in json.dumps(want) and "/tmp" not in text
  # It read every committed summary.
  summaries = sorted(f[:-5] for f in os.listdir(os.path.join(helpers.ROOT, "results"))
                     if f.endswith(".json"))
  assert f"{len(summaries)} committed summaries (results/*.json)" in text


PER_LAYER = "## Per-layer analysis"
DEBUG_LINE = "NOTEBOOK_NUMBERS"  # a debug print the routing notebook was once committed with


def _per_layer_cells(nb) -> list[int]:
  """The indices of the code cells under the routing notebook's per-layer heading."""
  start = next(i for i, c in enumerate(nb.cells)
               if c.cell_type == "markdown" and c.source.startswith(PER_LAYER))
  return [i for i, c in enumerate(nb.cells) if i > start and c.cell_type == "code"]


def _per_layer_problems(nb) -> list[str]:
  """A per-layer code cell without outputs, or a cell anywhere printing the debug line (in
  its outputs, or in its code: the next execution would print it)."""
  out = [f"cell {i} has no outputs" for i in _per_layer_cells(nb) if not nb.cells[i].outputs]
  return out + [f"cell {i} prints {DEBUG_LINE}" for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and DEBUG_LINE in c.source + json.dumps(c.outputs)]


def test_the_committed_routing_notebooks_per_layer_half_ran_without_debug_lines():
  """Cheap (reads the file), where the fresh-execution comparison of this notebook is slow."""
  nb = nbformat.read(notebooks.path_of(helpers.ROOT, "routing_analysis"), as_version=4)
  cells = _per_layer_cells(nb)
  assert len(cells) >= 6  # the runs, specialisation, MI/H, the check, load, co-activation
  assert _per_layer_problems(nb) == [], (
      "notebooks/routing_analysis.ipynb. Fix: python -m experiments.report --notebooks")
  # The check finds what it looks for: an emptied cell, a debug line.
  first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
  nb.cells[cells[-1]].outputs = []
  nb.cells[first].outputs.append(nbformat.v4.new_output("stream", text=f"{DEBUG_LINE} {{}}\n"))
  assert _per_layer_problems(nb) == [f"cell {cells[-1]} has no outputs",
                                     f"cell {first} prints {DEBUG_LINE}"]


@pytest.mark.parametrize("name", notebooks.NOTEBOOKS)
def test_notebook_executes_on_a_suite_directory(name, tiny_suite_dir):
  workdir, _, _ = tiny_suite_dir
  text = _check_ran(notebooks.execute(helpers.ROOT, name, suite_dir=workdir))
  assert "suite directory of tiny | arms: ['aux', 'bias']" in text
  if name != "routing_analysis":
    assert "the suite's summary.json has the same comparisons" in text
    return
  # Every MoE layer, the whole split, and the same numbers as the suite summary.
  assert "MoE layers: ['layer_0', 'layer_1']" in text
  # The notebook asserts its own numbers equal the summary's (rtol 1e-9; an error output
  # fails _check_ran) and prints one line per arm and key it compared.
  compared = re.findall(r"^(\S+)\s+(\S+)\s+notebook \S+\s+summary \S+$", text, re.M)
  assert {arm for arm, _ in compared} == {"aux", "bias"}
  assert {key for _, key in compared} >= {"specialisation_mi_norm"}
  assert "summaries without a load matrix (written before the plot data, or no routed " \
         "layer): none" in text  # the suite directory's summary has the load matrices
