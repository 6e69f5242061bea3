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

from moejax.interop import import_moe_block  # noqa: E402
from tests.interop import helpers  # noqa: E402

RTOL = 1e-5
SEEDS = (0, 1, 2)
TOKENS = (1, 9, 48)


_apply = helpers.apply_layer

# (id, model_type, HF config overrides, extra block options)
CASES = [
    ("mixtral", "mixtral", {}, {}),
    ("mixtral-top3", "mixtral", {"num_experts_per_tok": 3}, {}),
    ("qwen2-norm", "qwen2_moe", {"norm_topk_prob": True}, {}),
    ("qwen2-nonorm", "qwen2_moe", {"norm_topk_prob": False}, {}),
    ("qwen3-norm", "qwen3_moe", {"norm_topk_prob": True}, {}),
    ("qwen3-nonorm-top4", "qwen3_moe", {"norm_topk_prob": False, "num_experts_per_tok": 4}, {}),
    # group-limited: 4 groups of 2, best 2 groups; scaled, renormalised gates.
    ("dsv3-groups", "deepseek_v3", {"n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                                    "routed_scaling_factor": 2.5}, {"bias_std": 0.1}),
    # one group of 2 for top-2: the group rule alone decides; a large bias
    # makes biased keys negative (masking to 0 instead of -inf would differ).
    ("dsv3-one-group-negative", "deepseek_v3",
     {"n_group": 4, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
     {"bias_std": 1.0}),
    ("dsv3-no-groups", "deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                                       "n_shared_experts": 1}, {"bias_std": 0.3}),
]


def _check(model_type, overrides, options, seed, tokens):
  block, hf_cfg = helpers.make_block(model_type, seed, **options, **overrides)
  x = helpers.ties_free_inputs(block, hf_cfg, tokens, seed)
  want = helpers.hf_forward(block, x)
  want_ids, want_w = helpers.hf_routing(block, x)

  imported = import_moe_block(block.state_dict(), hf_cfg, prefix="")
  y, ids, w = (np.asarray(a) for a in _apply(imported.params, x, imported.state,
                                             imported.cfg))
  order = np.argsort(ids, axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), want_ids)
  np.testing.assert_allclose(np.take_along_axis(w, order, -1), want_w, rtol=1e-6, atol=1e-6)
  err = float(np.max(np.abs(y - want)))
  assert err <= RTOL * max(1.0, float(np.max(np.abs(want)))), (err, np.max(np.abs(want)))
  return block, hf_cfg, x, err


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
