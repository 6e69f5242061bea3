"""The notebooks run top to bottom on a suite's results (the tiny suite here)."""

from __future__ import annotations

import os

import nbclient
import nbformat
import pytest

from tests.ablation import helpers

# Every test here uses the tiny suite run (conftest, shared with the runner and
# compare tests): ~40 s of compilation on an idle 2-core machine.


@pytest.mark.parametrize("name", ["ablation_results", "routing_analysis"])
def test_notebook_executes(name, tiny_suite_dir, monkeypatch):
  workdir, _, _ = tiny_suite_dir
  monkeypatch.setenv("MOEJAX_RESULTS", workdir)  # the kernel inherits the environment
  nb = nbformat.read(os.path.join(helpers.ROOT, "notebooks", f"{name}.ipynb"), as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": helpers.ROOT}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images  # the plots were drawn
