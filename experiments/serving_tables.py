"""Markdown tables of the serving experiments' result JSONs (docs/serving.md, RESULTS.md).

Kept apart from the binaries so that a test can render a committed JSON
without importing a binary's absl flags (two binaries in one process would
define ``--json_out`` twice).
"""

from __future__ import annotations


def quantization_table(res: dict) -> str:
  """One result (moejax or hf) as a Markdown table (docs/serving.md)."""
  base = res["float_expert_bytes"]
  lines = ["| scheme | val loss | change | routing changed | top-1 agree | expert MB | saved |",
           "|---|---|---|---|---|---|---|"]
  for label, r in res["rows"].items():
    lines.append(f"| {label} | {r['val_loss']:.4f} | {r['val_loss_delta']:+.4f} | "
                 f"{100 * r['routing_changed']:.2f}% | {100 * r['top1_agree']:.2f}% | "
                 f"{r['expert_bytes'] / 1e6:.3f} | {100 * (1 - r['expert_bytes'] / base):.1f}% |")
  return "\n".join(lines)
