"""The notebooks run top to bottom on a suite's results (the tiny suite here), and the
routing notebook's numbers are the summary's."""

from __future__ import annotations

import json
import os

import nbclient
import nbformat
import pytest

from tests.ablation import helpers

# Every test here uses the tiny suite run (conftest, shared with the runner and
# compare tests).


def _execute(name, workdir, monkeypatch):
  monkeypatch.setenv("MOEJAX_RESULTS", workdir)  # the kernel inherits the environment
  nb = nbformat.read(os.path.join(helpers.ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": helpers.ROOT}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  assert [o for o in outputs if "image/png" in o.get("data", {})]  # the plots were drawn
  return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


@pytest.mark.parametrize("name", ["ablation_results", "routing_analysis"])
def test_notebook_executes(name, tiny_suite_dir, monkeypatch):
  workdir, _, _ = tiny_suite_dir
  text = _execute(name, workdir, monkeypatch)
  if name != "routing_analysis":
    return
  # Every MoE layer, the whole split, and the same numbers as the suite summary.
  assert "MoE layers: ['layer_0', 'layer_1']" in text
  line = next(x for x in text.splitlines() if x.startswith("NOTEBOOK_NUMBERS "))
  numbers = json.loads(line.split(" ", 1)[1])
  with open(os.path.join(workdir, "summary.json")) as f:
    summ = json.load(f)
  assert set(numbers) == {"aux", "bias"}
  for arm, vals in numbers.items():
    for key, v in vals.items():
      assert v == pytest.approx(summ["arms"][arm]["metrics"][key]["interval"]["mean"],
                                rel=1e-9, abs=1e-12), (arm, key)
