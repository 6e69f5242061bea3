"""Imported layers reproduce the transformers MoE blocks (float32, CPU).

Every case builds a random HF block of the family, draws ties-free tokens
(no routing decision within 1e-4 of a tie, so rounding cannot flip a choice),
imports the block's own state dict and checks, for several seeds and token
counts: the same experts per token, the same gates, and the same output to
float32 tolerance (max abs error <= 1e-5 x max |y|, floor 1e-5).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from moejax.interop import import_moe_block, parity  # noqa: E402
from tests.interop import helpers  # noqa: E402

RTOL = 1e-5
SEEDS = (0, 1, 2)
TOKENS = (1, 9, 48)


_apply = helpers.apply_layer
CASES = list(parity.CASES)


def _check(model_type, overrides, options, seed, tokens):
  got = parity.block_parity(model_type, seed, tokens, options, **overrides)
  np.testing.assert_array_equal(got["ids"], got["want_ids"])
  np.testing.assert_allclose(got["gates"], got["want_gates"], rtol=1e-6, atol=1e-6)
  assert got["same_experts"]
  want = got["want"]
  assert got["max_abs"] <= RTOL * max(1.0, float(np.max(np.abs(want)))), (got["max_abs"],
                                                                           np.max(np.abs(want)))
  return got["block"], got["hf_cfg"], got["x"], got["max_abs"]


# Token counts are swept on a softmax and the group-limited sigmoid case (each
# count is one XLA compile); the rest run at one count, all with 3 seeds.
SWEEP = {"mixtral", "dsv3-groups"}
GRID = [(c, t) for c in CASES for t in (TOKENS if c[0] in SWEEP else (TOKENS[-1],))]


@pytest.mark.parametrize("case,tokens", GRID, ids=[f"{c[0]}-T{t}" for c, t in GRID])
def test_block_parity(case, tokens):
  _, model_type, overrides, options = case
  for seed in SEEDS:
    _check(model_type, overrides, options, seed, tokens)


def test_group_limit_changes_selection():
  """The group-limited case really is: the unlimited top-K differs for some tokens."""
  _, model_type, overrides, options = CASES[6]
  block, hf_cfg, x, _ = _check(model_type, overrides, options, 0, 48)
  sel = helpers.selection(block, hf_cfg, x)
  ids, _ = helpers.hf_routing(block, x)
  assert np.any(np.any(sel["unlimited"] != ids, axis=-1))


def test_negative_keys_inside_chosen_groups():
  """Biased keys below 0 are chosen: masking other groups to 0 would pick those instead."""
  _, model_type, overrides, options = CASES[7]
  block, hf_cfg, x, _ = _check(model_type, overrides, options, 0, 48)
  assert np.any(helpers.selection(block, hf_cfg, x)["kth"] < 0)


def test_batched_input_matches_flat():
  """[B, S, d] input: the HF block and moejax agree with B > 1 too."""
  block, hf_cfg = helpers.make_block("qwen2_moe", 3)
  x = helpers.ties_free_inputs(block, hf_cfg, 12, 3).reshape(3, 4, -1)
  with torch.no_grad():
    want = block(torch.from_numpy(x)).numpy()
  imported = import_moe_block(block.state_dict(), hf_cfg, prefix="")
  y, _, _ = _apply(imported.params, x, imported.state, imported.cfg)
  assert y.shape == x.shape
  np.testing.assert_allclose(np.asarray(y), want, atol=RTOL * max(1, np.abs(want).max()))
