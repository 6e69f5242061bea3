"""Table cells are rounded to what their interval supports (moejax.ablation.tables)."""

import pytest

from moejax.ablation import tables


@pytest.mark.parametrize("half, value, want", [
    (0.006488, -0.002926, 4),    # the second significant digit of 0.0065
    (0.0051, 1.51612, 4),
    (10.0, 12.34, 0),
    (1e-9, 1.5, 5),              # at most 6 significant digits of the value
    (0.0, 0.3, None), (None, 0.3, None),
])
def test_places_show_the_half_width_to_two_digits(half, value, want):
  assert tables.places(half, value) == want


def test_a_difference_and_its_interval_share_the_intervals_precision():
  iv = {"lo": -0.009414, "hi": 0.003562}
  assert tables._interval(iv) == "[-0.0094, +0.0036]"
  summary = {"baseline": "a", "comparisons": {"b": {"val_loss": {
      "diff": {"mean": -0.002926, "n": 3, **iv}, "documents": {"lo": -0.0041, "hi": -0.0017},
      "pairing": "paired", "verdict": "unresolved", "reason": "r"}}}}
  row = tables.comparison_table(summary).splitlines()[2]
  assert "| -0.0029 | [-0.0094, +0.0036] (3) | [-0.0041, -0.0017] |" in row


def test_an_arms_cell_is_its_mean_to_the_intervals_precision_and_without_one_4_digits():
  assert tables._cell({"interval": {"mean": 1.51612, "lo": 1.511, "hi": 1.5212}},
                      "val_loss") == "1.5161 ± 0.0051"
  assert tables._cell({"interval": {"mean": 1.51612, "lo": None, "hi": None}},
                      "val_loss") == "1.516"
  assert tables._cell({"interval": {"mean": 0.0, "lo": 0.0, "hi": 0.0}}, "x") == "0 ± 0"
