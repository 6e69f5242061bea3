"""summary.csv holds only the columns that have a value in some row, in their usual order."""

from __future__ import annotations

import csv

from moejax.ablation import summary


def _arm(val_loss, drop_rate=None) -> dict:
  metrics = {"val_loss": {"interval": {"mean": val_loss, "lo": val_loss - 0.1,
                                       "hi": val_loss + 0.1, "n": 2}}}
  if drop_rate is not None:
    metrics["drop_rate"] = {"interval": {"mean": drop_rate, "lo": None, "hi": None, "n": 1}}
  return {"suite": "tiny", "seeds": [0, 1], "metrics": metrics,
          "budget": {"total": 100, "active": 50, "flops_per_token": 300, "tokens": 1000}}


def test_columns_empty_in_every_row_are_left_out(tmp_path):
  path = str(tmp_path / "summary.csv")
  summary.write_csv({"arms": {"aux": _arm(2.5), "bias": _arm(2.25, drop_rate=0.0)}}, path)
  with open(path, newline="", encoding="utf-8") as f:
    rows = list(csv.reader(f))
  assert rows[0] == ["arm", "suite", "seeds", "total", "active", "flops_per_token", "tokens",
                     "val_loss", "val_loss_lo", "val_loss_hi", "val_loss_n", "drop_rate",
                     "drop_rate_n"]
  assert rows[1] == ["aux", "tiny", "2", "100", "50", "300", "1000", "2.5", "2.4", "2.6", "2", "",
                     ""]
  assert rows[2][-2:] == ["0.0", "1"]
  back = summary.read_csv(path)
  assert back[1]["drop_rate"] == 0.0 and back[0]["drop_rate"] is None
