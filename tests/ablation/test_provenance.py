"""moejax.ablation.provenance.command_line: the command a record names."""

from __future__ import annotations

from moejax.ablation import provenance


def test_any_binary_under_experiments_is_named_as_python_dash_m():
  for name in ("ablate", "train", "bench", "routing_consistency"):
    argv = [f"/work/repo/experiments/{name}.py", "--suite=layer", "--json_out=a b.json"]
    assert provenance.command_line(argv) == (
        f"python -m experiments.{name} --suite=layer '--json_out=a b.json'")


def test_other_callers_are_named_as_such():
  assert provenance.command_line(["/usr/bin/pytest", "-q"]) == "(called from Python: pytest -q)"
  assert provenance.command_line(["/x/experiments/sub/tool.py"]) == (
      "(called from Python: tool.py)")
  assert provenance.command_line([]) == "(unknown)"
