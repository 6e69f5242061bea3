"""Fine-grained segmentation and DeepSeekMoE isolation keep the budget."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import pytest

from moejax.config import ConfigError, ModelConfig, MoEConfig, RouterConfig
from moejax.topology import accounting, segmentation

D = 16


def _moe(**kw):
  router = kw.pop("router", RouterConfig(top_k=2))
  return MoEConfig(**{"num_experts": 8, "expert_width": 64, "router": router, **kw})


def _expert_budget(moe: MoEConfig):
  """(total, active) of the expert parameters (routed + shared + zero-compute)."""
  comps = accounting.moe_components(moe, D, seq_len=32)
  names = ("routed_experts", "shared_experts", "zero_compute")
  return (sum(comps[n].total for n in names if n in comps),
          sum(comps[n].active for n in names if n in comps))


def test_fine_grain_hand_made():
  cfg = _moe(num_shared_experts=1)
  fine = segmentation.fine_grain(cfg, 4)
  assert (fine.num_experts, fine.expert_width, fine.router.top_k) == (32, 16, 8)
  # Shared experts are untouched, and their width is pinned to the old routed width.
  assert (fine.num_shared_experts, fine.shared_expert_width) == (1, 64)
  assert segmentation.fine_grain(cfg, 1) is cfg


def test_fine_grain_keeps_total_and_active_parameters():
  cfg = ModelConfig(vocab_size=32, d_model=D, n_layers=2, n_heads=2, dense_ff_width=32,
                    moe=_moe(num_shared_experts=2, shared_expert_width=32))
  fine = dataclasses.replace(cfg, moe=segmentation.fine_grain(cfg.moe, 4))
  a, b = accounting.budget(cfg, 32), accounting.budget(fine, 32)
  for name in ("routed_experts", "shared_experts"):
    assert a.breakdown[name].total == b.breakdown[name].total
    assert a.breakdown[name].active == b.breakdown[name].active
  # Only the router grows: d E -> d m E columns in each of the 2 layers.
  assert b.total - a.total == 2 * D * 8 * 3
  assert b.active - a.active == 2 * D * 8 * 3


def test_split_shared():
  cfg = _moe(num_shared_experts=2, shared_expert_width=32)
  fine = segmentation.fine_grain(cfg, 4, split_shared=True)
  assert (fine.num_shared_experts, fine.shared_expert_width) == (8, 8)
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_heterogeneous_widths_split_in_place():
  cfg = MoEConfig(num_experts=2, expert_widths=(4, 8), router=RouterConfig(top_k=1))
  fine = segmentation.fine_grain(cfg, 2)
  assert fine.expert_widths == (2, 2, 4, 4) and fine.router.top_k == 2
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_not_divisible_is_a_clear_error():
  with pytest.raises(ConfigError, match=r"moe.expert_width=64.*not divisible.*m=3"):
    segmentation.fine_grain(_moe(), 3)
  with pytest.raises(ConfigError, match=r"moe.expert_widths"):
    segmentation.fine_grain(MoEConfig(num_experts=2, expert_widths=(4, 6),
                                      router=RouterConfig(top_k=1)), 4)
  with pytest.raises(ConfigError, match="shared_expert_width"):
    segmentation.fine_grain(_moe(num_shared_experts=1, shared_expert_width=6), 4,
                            split_shared=True)
  with pytest.raises(ConfigError, match="integer >= 1"):
    segmentation.fine_grain(_moe(), 0)
  with pytest.raises(ConfigError, match="PEER"):
    segmentation.fine_grain(MoEConfig(kind="peer"), 2)


def test_zero_compute_and_expert_choice_keep_active():
  zc = _moe(zero_experts=2, copy_experts=1)
  fine = segmentation.fine_grain(zc, 2)
  assert (fine.zero_experts, fine.copy_experts) == (4, 2)
  assert _expert_budget(fine) == _expert_budget(zc)
  # Constant experts have width-independent parameters (W_c [d, 2], v [d]):
  # the routed FFN budget is kept, theirs grows with their count.
  const = _moe(constant_experts=2)
  a = accounting.moe_components(const, D, 32)
  b = accounting.moe_components(segmentation.fine_grain(const, 2), D, 32)
  assert (a["routed_experts"].total, a["routed_experts"].active) == \
      (b["routed_experts"].total, b["routed_experts"].active)
  assert b["zero_compute"].total == 2 * a["zero_compute"].total == 4 * 3 * D
  ec = _moe(router=RouterConfig(kind="expert_choice", expert_choice_capacity=2.0))
  fine = segmentation.fine_grain(ec, 4)
  assert fine.router.expert_choice_capacity == 8.0
  assert _expert_budget(fine) == _expert_budget(ec)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(e=st.integers(1, 16), w=st.integers(1, 8), k=st.integers(1, 4),
                  m=st.sampled_from([1, 2, 3, 4, 8]), shared=st.integers(0, 2),
                  swiglu=st.booleans())
def test_fine_grain_invariance_property(e, w, k, m, shared, swiglu):
  hypothesis.assume(k <= e)
  cfg = MoEConfig(num_experts=e, expert_width=w * m, num_shared_experts=shared,
                  activation="swiglu" if swiglu else "gelu", router=RouterConfig(top_k=k))
  fine = segmentation.fine_grain(cfg, m)
  assert (fine.num_experts, fine.router.top_k) == (e * m, k * m)
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_deepseekmoe_hand_made():
  base = MoEConfig(num_experts=16, expert_width=1024, router=RouterConfig(top_k=2))
  ds = segmentation.deepseekmoe(base, m=4, num_shared=1)
  assert (ds.num_experts, ds.expert_width, ds.router.top_k) == (63, 256, 7)
  assert (ds.num_shared_experts, ds.shared_expert_width) == (1, 256)
  assert _expert_budget(ds) == _expert_budget(base)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(n=st.integers(2, 16), k=st.integers(1, 3), m=st.sampled_from([1, 2, 4]),
                  ks=st.integers(0, 3))
def test_deepseekmoe_invariance_property(n, k, m, ks):
  hypothesis.assume(k <= n and ks < m * k)
  base = MoEConfig(num_experts=n, expert_width=8 * m, router=RouterConfig(top_k=k))
  ds = segmentation.deepseekmoe(base, m, ks)
  assert ds.num_experts + ds.num_shared_experts == n * m
  assert ds.router.top_k + ds.num_shared_experts == m * k
  assert _expert_budget(ds) == _expert_budget(base)


def test_deepseekmoe_errors():
  base = MoEConfig(num_experts=4, expert_width=8, router=RouterConfig(top_k=1))
  with pytest.raises(ConfigError, match=r"num_shared=2.*m K = 2"):
    segmentation.deepseekmoe(base, 2, 2)
  with pytest.raises(ConfigError, match="already has shared experts"):
    segmentation.deepseekmoe(dataclasses.replace(base, num_shared_experts=1), 2, 1)
  grouped = MoEConfig(num_experts=8, expert_width=8,
                      router=RouterConfig(top_k=2, n_groups=4, topk_groups=2))
  with pytest.raises(ConfigError, match="n_groups"):
    segmentation.deepseekmoe(grouped, 2, 1)
