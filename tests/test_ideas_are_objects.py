"""No module compares a router, layer kind or optimizer with a string: it asks the idea.

docs/design.md, "Ideas are objects": outside the registries, code reads a
capability (``cfg.router.supports_bias``, ``cfg.layer.causal``), never
``routing.kind == "hash"``. The check walks every comparison in
``moejax/`` and ``experiments/``: one whose literal names a registered router
or layer kind while the other side mentions a ``kind``, or an optimizer while
the other side mentions an ``optimizer``, is refused.
"""

import ast
import pathlib

import pytest

from moejax.config.registry import LAYERS, OPTIMIZERS, ROUTERS

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The registries themselves hold the names.
ALLOWED = {"moejax/config/registry.py"}


def _files():
  return sorted(p for d in ("moejax", "experiments") for p in (ROOT / d).rglob("*.py")
                if "__pycache__" not in p.parts)


def _literals(node):
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    yield node.value
  elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    for elt in node.elts:
      yield from _literals(elt)


def kind_comparisons(path: pathlib.Path) -> list[str]:
  """'line: source' of each comparison of a kind with a registered kind's name."""
  kinds = set(ROUTERS.names()) | set(LAYERS.names())
  optimizers = set(OPTIMIZERS.names())
  text = path.read_text(encoding="utf-8")
  out = []
  for node in ast.walk(ast.parse(text)):
    if not isinstance(node, ast.Compare):
      continue
    sides = [node.left, *node.comparators]
    for i, side in enumerate(sides):
      literals = set(_literals(side))
      others = " ".join(ast.unparse(s) for j, s in enumerate(sides) if j != i).lower()
      if (literals & kinds and "kind" in others) or (literals & optimizers
                                                     and "optimizer" in others):
        out.append(f"{node.lineno}: {ast.unparse(node)}")
  return out


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_kind_is_compared_with_a_string(path):
  if str(path.relative_to(ROOT)) in ALLOWED:
    return
  found = kind_comparisons(path)
  assert not found, (f"{path.relative_to(ROOT)} compares a kind with a name; ask the "
                     f"registered object's capabilities instead:\n  " + "\n  ".join(found))


def test_the_check_sees_a_literal_kind_comparison(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text("def f(cfg):\n  return cfg.routing.kind in ('hash', 'x') or "
                   "cfg.kind != 'soft'\n", encoding="utf-8")
  assert len(kind_comparisons(probe)) == 2
