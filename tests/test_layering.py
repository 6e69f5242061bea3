"""The import graph runs one way: planes import only downward (docs/design.md).

Every ``import`` and ``from ... import`` of every module under ``moejax/``
counts, at module level and inside functions alike, so a function-local
import cannot hide an arrow that runs back up.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moejax"

# plane -> the moejax modules (prefixes) it may import besides itself.
ALLOWED = {
    "moejax.config": (),
    "moejax.routing": ("moejax.config",),
    "moejax.topology": ("moejax.config",),
    "moejax.balance": ("moejax.config", "moejax.routing.types"),
}
# plane -> the moejax modules (prefixes) it must never import.
FORBIDDEN = {
    "moejax.execution": ("moejax.layer", "moejax.nn", "moejax.model", "moejax.train",
                         "moejax.evaluate", "moejax.ablation", "moejax.interop", "moejax.data"),
    "moejax.layer": ("moejax.nn", "moejax.model", "moejax.train", "moejax.evaluate",
                     "moejax.ablation", "moejax.interop", "moejax.data"),
    "moejax.nn": ("moejax.model", "moejax.train", "moejax.evaluate", "moejax.ablation"),
    "moejax.model": ("moejax.train", "moejax.evaluate", "moejax.ablation"),
    "moejax.evaluate": ("moejax.train", "moejax.ablation"),
}
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  parts = list(rel.parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _is_module(dotted: str) -> bool:
  base = ROOT.joinpath(*dotted.split("."))
  return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: pathlib.Path) -> set[str]:
  """Every moejax module ``path`` imports (``from moejax import layer`` -> moejax.layer)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  here = _module_name(path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith("moejax"))
    elif isinstance(node, ast.ImportFrom):
      mod = node.module or ""
      if node.level:  # relative import
        base = here.split(".")[: -node.level] if not path.name == "__init__.py" else \
            here.split(".")[: len(here.split(".")) - node.level + 1]
        mod = ".".join(base + ([mod] if mod else []))
      if not mod.startswith("moejax"):
        continue
      for alias in node.names:
        sub = f"{mod}.{alias.name}"
        out.add(sub if _is_module(sub) else mod)
  return out


def _modules():
  return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _within(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_planes_import_only_downward(path):
  here = _module_name(path)
  deps = imports_of(path)
  for plane, allowed in ALLOWED.items():
    if _within(here, plane):
      bad = [d for d in deps if not _within(d, plane) and d != "moejax"
             and not any(_within(d, a) for a in allowed)]
      assert not bad, f"{here} ({plane}) imports {bad}; it may import only {allowed or 'itself'}"
  for plane, forbidden in FORBIDDEN.items():
    if _within(here, plane):
      bad = [d for d in deps if any(_within(d, f) for f in forbidden)]
      assert not bad, f"{here} imports {bad}, which sit above {plane}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_the_size_limit(path):
  lines = len(path.read_text(encoding="utf-8").splitlines())
  assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (> {MAX_LINES})"


def test_the_checker_sees_upward_and_local_imports(tmp_path, monkeypatch):
  """The rule is not vacuous: a function-local upward import is caught."""
  fake = PKG / "execution" / "_layering_probe.py"
  fake.write_text("def f():\n  from moejax import layer\n  return layer\n", encoding="utf-8")
  try:
    with pytest.raises(AssertionError, match="moejax.layer"):
      test_planes_import_only_downward(fake)
  finally:
    fake.unlink()
