"""The notebooks run top to bottom on the committed results/ (their default) and on a suite
directory (the tiny suite here); they are committed executed, with the outputs a fresh
execution gives; the routing notebook's numbers are the summary's."""

from __future__ import annotations

import json
import os
import re

import nbformat
import pytest

from moejax.ablation import notebooks
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
