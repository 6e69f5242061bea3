"""Fine-grained segmentation and DeepSeekMoE isolation keep the budget."""

import dataclasses

import hypothesis
import hypothesis.strategies as st
import pytest

from moejax.config import ConfigError, ModelConfig, MoEConfig, RoutingConfig
from moejax.config import segmentation
from moejax.topology import accounting
from tests.configs import moe_config

D = 16


def _moe(**kw):
  routing = kw.pop("routing", RoutingConfig(top_k=2))
  return moe_config(**{"num_experts": 8, "expert_width": 64, "routing": routing, **kw})


def _expert_budget(moe: MoEConfig):
  """(total, active) of the expert parameters (routed + shared + zero-compute)."""
  comps = accounting.moe_components(moe, D, seq_len=32)
  names = ("routed_experts", "shared_experts", "zero_compute")
  return (sum(comps[n].total for n in names if n in comps),
          sum(comps[n].active for n in names if n in comps))


def test_fine_grain_hand_made():
  cfg = _moe(num_shared_experts=1)
  fine = segmentation.fine_grain(cfg, 4)
  assert (fine.num_experts, fine.topology.expert_width, fine.routing.top_k) == (32, 16, 8)
  # Shared experts are untouched, and their width is pinned to the old routed width.
  assert (fine.topology.num_shared_experts, fine.topology.shared_expert_width) == (1, 64)
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
  assert (fine.topology.num_shared_experts, fine.topology.shared_expert_width) == (8, 8)
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_heterogeneous_widths_split_in_place():
  cfg = moe_config(num_experts=2, expert_widths=(4, 8), routing=RoutingConfig(top_k=1))
  fine = segmentation.fine_grain(cfg, 2)
  assert fine.topology.expert_widths == (2, 2, 4, 4) and fine.routing.top_k == 2
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_not_divisible_is_a_clear_error():
  with pytest.raises(ConfigError, match=r"moe.topology.expert_width=64.*not divisible.*m=3"):
    segmentation.fine_grain(_moe(), 3)
  with pytest.raises(ConfigError, match=r"moe.topology.expert_widths"):
    segmentation.fine_grain(moe_config(num_experts=2, expert_widths=(4, 6),
                                      routing=RoutingConfig(top_k=1)), 4)
  with pytest.raises(ConfigError, match="shared_expert_width"):
    segmentation.fine_grain(_moe(num_shared_experts=1, shared_expert_width=6), 4,
                            split_shared=True)
  with pytest.raises(ConfigError, match="integer >= 1"):
    segmentation.fine_grain(_moe(), 0)
  with pytest.raises(ConfigError, match="PEER"):
    segmentation.fine_grain(moe_config(kind="peer"), 2)


def test_zero_compute_and_expert_choice_keep_active():
  zc = _moe(zero_experts=2, copy_experts=1)
  fine = segmentation.fine_grain(zc, 2)
  assert (fine.topology.zero_experts, fine.topology.copy_experts) == (4, 2)
  assert _expert_budget(fine) == _expert_budget(zc)
  # Constant experts have width-independent parameters (W_c [d, 2], v [d]):
  # the routed FFN budget is kept, theirs grows with their count.
  const = _moe(constant_experts=2)
  a = accounting.moe_components(const, D, 32)
  b = accounting.moe_components(segmentation.fine_grain(const, 2), D, 32)
  assert (a["routed_experts"].total, a["routed_experts"].active) == \
      (b["routed_experts"].total, b["routed_experts"].active)
  assert b["zero_compute"].total == 2 * a["zero_compute"].total == 4 * 3 * D
  ec = _moe(routing=RoutingConfig.build(kind="expert_choice", capacity=2.0))
  fine = segmentation.fine_grain(ec, 4)
  assert fine.routing.opts.capacity == 8.0
  assert _expert_budget(fine) == _expert_budget(ec)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(e=st.integers(1, 16), w=st.integers(1, 8), k=st.integers(1, 4),
                  m=st.sampled_from([1, 2, 3, 4, 8]), shared=st.integers(0, 2),
                  swiglu=st.booleans())
def test_fine_grain_invariance_property(e, w, k, m, shared, swiglu):
  hypothesis.assume(k <= e)
  cfg = moe_config(num_experts=e, expert_width=w * m, num_shared_experts=shared,
                  activation="swiglu" if swiglu else "gelu", routing=RoutingConfig(top_k=k))
  fine = segmentation.fine_grain(cfg, m)
  assert (fine.num_experts, fine.routing.top_k) == (e * m, k * m)
  assert _expert_budget(fine) == _expert_budget(cfg)


def test_deepseekmoe_hand_made():
  base = moe_config(num_experts=16, expert_width=1024, routing=RoutingConfig(top_k=2))
  ds = segmentation.deepseekmoe(base, m=4, num_shared=1)
  assert (ds.num_experts, ds.topology.expert_width, ds.routing.top_k) == (63, 256, 7)
  assert (ds.topology.num_shared_experts, ds.topology.shared_expert_width) == (1, 256)
  assert _expert_budget(ds) == _expert_budget(base)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(n=st.integers(2, 16), k=st.integers(1, 3), m=st.sampled_from([1, 2, 4]),
                  ks=st.integers(0, 3))
def test_deepseekmoe_invariance_property(n, k, m, ks):
  hypothesis.assume(k <= n and ks < m * k)
  base = moe_config(num_experts=n, expert_width=8 * m, routing=RoutingConfig(top_k=k))
  ds = segmentation.deepseekmoe(base, m, ks)
  assert ds.num_experts + ds.topology.num_shared_experts == n * m
  assert ds.routing.top_k + ds.topology.num_shared_experts == m * k
  assert _expert_budget(ds) == _expert_budget(base)


def test_deepseekmoe_errors():
  base = moe_config(num_experts=4, expert_width=8, routing=RoutingConfig(top_k=1))
  with pytest.raises(ConfigError, match=r"isolate_shared=2.*m K = 2"):
    segmentation.deepseekmoe(base, 2, 2)
  with pytest.raises(ConfigError, match="already has shared experts"):
    segmentation.deepseekmoe(moe_config(num_experts=4, expert_width=8, num_shared_experts=1,
                                        routing=RoutingConfig(top_k=1)), 2, 1)
  grouped = moe_config(num_experts=8, expert_width=8,
                      routing=RoutingConfig(top_k=2, n_groups=4, topk_groups=2))
  with pytest.raises(ConfigError, match="n_groups"):
    segmentation.deepseekmoe(grouped, 2, 1)


# --- The config knobs: topology.granularity / isolate_shared. ---------------

def test_knobs_resolve_to_the_transforms_when_the_config_is_built():
  coarse = moe_config(num_experts=8, expert_width=128, routing=dict(top_k=2))
  fine = moe_config(num_experts=8, expert_width=128, granularity=4, routing=dict(top_k=2))
  by_hand = segmentation.fine_grain(coarse, 4)
  assert fine.topology.granularity == 1 and "granularity=4" in fine.topology.derived_from
  assert (fine.num_experts, fine.topology.expert_width, fine.routing.top_k) == (32, 32, 8)
  assert dataclasses.replace(fine.topology, derived_from="") == by_hand.topology
  assert fine.routing == by_hand.routing
  ds = moe_config(num_experts=8, expert_width=128, granularity=4, isolate_shared=1,
                  routing=dict(top_k=2))
  assert (ds.num_experts, ds.routing.top_k, ds.topology.num_shared_experts,
          ds.topology.shared_expert_width) == (31, 7, 1, 32)


def test_resolution_is_idempotent_through_the_saved_dict():
  from moejax.config import from_dict, to_dict
  fine = moe_config(num_experts=8, expert_width=128, granularity=2, routing=dict(top_k=2))
  again = from_dict(MoEConfig, to_dict(fine))
  assert again == fine  # the saved config.json holds resolved numbers and granularity 1


def test_granularity_arm_equals_the_hand_made_fine_grained_arm():
  """The granularity suite's knob arm has the shapes and parameter counts of the
  arm the suite used to copy in by hand (fine_grain of the coarse layer)."""
  from moejax.ablation import suite as suite_lib
  from moejax.config import files
  suite = suite_lib.load_suite(str(files.repo_root() / "configs/ablations/granularity.py"))
  arms = {a.name: a.experiment for a in suite.arms}
  coarse = arms["coarse"].model
  by_hand = dataclasses.replace(coarse, moe=segmentation.fine_grain(coarse.moe, 4))
  knob = arms["fine_m4"].model
  assert knob.moe.topology.expert_width == by_hand.moe.topology.expert_width == 32
  assert knob.moe.num_experts == by_hand.moe.num_experts == 32
  assert knob.moe.routing == by_hand.moe.routing
  a, b = accounting.budget(knob, 64), accounting.budget(by_hand, 64)
  assert (a.total, a.active, a.flops_per_token) == (b.total, b.active, b.flops_per_token)


def test_bad_knobs_name_the_field():
  with pytest.raises(ConfigError, match="moe.topology.expert_width=6: width 6 is not divisible"):
    moe_config(num_experts=4, expert_width=6, granularity=4)
  with pytest.raises(ConfigError, match="moe.topology.granularity=0"):
    moe_config(num_experts=4, expert_width=8, granularity=0)
