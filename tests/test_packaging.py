"""The package's licence and extras, as setup.py declares them (read, not installed)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The Apache License 2.0 as the Apache Software Foundation publishes it (JAX's and Flax's
# licence), its appendix's copyright line filled in.
APACHE_2_HEAD = "Apache License\n                           Version 2.0, January 2004"


def _setup_keywords() -> dict:
  with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "setup")
  out = {}
  for kw in call.keywords:
    try:
      out[kw.arg] = ast.literal_eval(kw.value)
    except ValueError:
      pass  # computed (the long description)
  return out


def test_the_licence_is_apache_2_and_setup_py_says_so():
  with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
    text = f.read()
  assert APACHE_2_HEAD in text and "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND" in text
  assert "END OF TERMS AND CONDITIONS" in text and text.rstrip().endswith(
      "limitations under the License.")
  assert "   Copyright The moejax Authors\n" in text
  assert _setup_keywords()["license"] == "Apache-2.0"


def test_the_notebooks_extra_installs_jupyters_command_line_and_a_kernel():
  extra = _setup_keywords()["extras_require"]["notebooks"]
  names = {r.split(">")[0].split("=")[0].split("<")[0] for r in extra}
  assert {"nbconvert", "jupyter_core", "ipykernel"} <= names
