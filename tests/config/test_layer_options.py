"""A layer kind's own options (moe.layer_options), and old config files that held them flat.

Soft MoE's slots and PEER's keys were fields of moe.topology (slots_per_expert,
peer_num_keys, ...). They are the kind's Options now; a config.json written
before loads through the table of relocated keys (moejax.config.core.RELOCATED).
"""

import copy
import json
import pathlib

import ml_collections
import pytest

from moejax.config import ConfigError, MoEConfig, apply_overrides, from_dict, moved_hint, to_dict
from moejax.routing.soft import SoftOptions
from moejax.topology.peer import PeerOptions
from moejax.train.config import (experiment_config_dict, experiment_from_dict,
                                 experiment_to_json)

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The moe section of a config.json written when the options were topology fields.
OLD_TOPOLOGY = {"activation": "swiglu", "constant_experts": 0, "copy_experts": 0,
                "derived_from": "", "expert_width": 256, "expert_widths": None,
                "granularity": 1, "isolate_shared": 0, "num_experts": 8,
                "num_shared_experts": 0, "shared_expert_gate": False,
                "shared_expert_width": None, "zero_experts": 0, "slots_per_expert": 1,
                "peer_num_keys": 32, "peer_heads": 4, "peer_top_k": 8, "peer_key_dim": 128}


def _old(kind: str, **topology) -> dict:
  return {"model": {"moe": {"kind": kind, "topology": {**OLD_TOPOLOGY, **topology}}}}


def test_an_old_style_config_loads_each_kind_with_its_options():
  peer = _old("peer", peer_num_keys=4, peer_heads=2, peer_top_k=2, peer_key_dim=8)
  before = copy.deepcopy(peer)
  moe = experiment_from_dict(peer).model.moe
  assert moe.layer_options == PeerOptions(num_keys=4, heads=2, top_k=2, key_dim=8)
  assert peer == before  # the loaded dict is left as it was
  soft = experiment_from_dict(_old("soft", slots_per_expert=3)).model.moe
  assert soft.layer_options == SoftOptions(slots_per_expert=3)
  # A routed layer: the other kinds' options at their defaults were never set.
  sparse = experiment_from_dict(_old("sparse")).model.moe
  assert to_dict(sparse.layer_options) == {} and sparse == MoEConfig()
  # The new form builds the same config, and config.json holds the new form.
  new = from_dict(MoEConfig, {"kind": "peer", "layer_options": dict(num_keys=4, heads=2,
                                                                  top_k=2, key_dim=8)})
  assert new == moe
  shown = json.loads(experiment_to_json(experiment_from_dict(peer)))["model"]["moe"]
  assert shown["layer_options"] == {"num_keys": 4, "heads": 2, "top_k": 2, "key_dim": 8}
  assert not {k for k in shown["topology"] if k.startswith("peer_") or k.startswith("slots")}


_OLD_KIND_FIELDS = {k: v for k, v in OLD_TOPOLOGY.items()
                    if k == "slots_per_expert" or k.startswith("peer_")}


def test_the_committed_runs_load_in_their_form_and_in_the_old_one():
  results = sorted((ROOT / "results" / "runs").glob("**/result.json"))
  assert results
  for path in results:
    tree = json.loads(path.read_text())["experiment"]
    moe = experiment_from_dict(tree).model.moe
    assert to_dict(moe.layer_options) == {}   # routed layers: no kind options
    # The same run as a config.json written when the options were topology fields.
    old = copy.deepcopy(tree)
    old["model"]["moe"].pop("layer_options", None)
    old["model"]["moe"]["topology"].update(_OLD_KIND_FIELDS)
    assert experiment_from_dict(old).model.moe == moe


def test_an_old_key_set_on_the_wrong_kind_is_one_line_naming_its_owner():
  with pytest.raises(ConfigError) as info:
    experiment_from_dict(_old("sparse", peer_heads=2))
  msg = str(info.value)
  assert "\n" not in msg
  assert msg.startswith("model.moe.layer_options.heads=2: is an option of moe.kind='peer'")
  assert "Fix: remove heads or set moe.kind='peer'" in msg
  with pytest.raises(ConfigError, match=r"layer_options.heads=2: given together with its old "
                                        r"key topology.peer_heads=4"):
    from_dict(MoEConfig, {"kind": "peer", "topology": {"peer_heads": 4},
                          "layer_options": {"heads": 2}})


@pytest.mark.parametrize("options, field, fix", [
    (dict(num_keys=4, top_k=5), "moe.layer_options.top_k=5",
     "set moe.layer_options.top_k <= moe.layer_options.num_keys"),
    (dict(key_dim=7), "moe.layer_options.key_dim=7", "use an even key dimension"),
    (dict(heads=0), "moe.layer_options.heads=0", "set moe.layer_options.heads >= 1"),
])
def test_peer_options_are_checked_in_one_line(options, field, fix):
  with pytest.raises(ConfigError) as info:
    from_dict(MoEConfig, {"kind": "peer", "layer_options": options})
  msg = str(info.value)
  assert msg.startswith(field + ": ") and msg.endswith("Fix: " + fix) and "\n" not in msg


def test_options_of_another_kind_are_refused():
  with pytest.raises(ConfigError, match=r"^moe.layer_options=SoftOptions\(slots_per_expert=1\): "
                                        r"are not the options of moe.kind='peer'"):
    MoEConfig(kind="peer", layer_options=SoftOptions())
  with pytest.raises(ConfigError, match="slots_per_expert=0: must be >= 1"):
    SoftOptions(slots_per_expert=0)
  assert MoEConfig(kind="soft").layer_options == SoftOptions()  # None: the kind's defaults


def test_overrides_of_an_old_key_name_the_new_place():
  assert moved_hint("model.moe.topology.peer_heads") == "moved to model.moe.layer_options.heads"
  assert moved_hint("model.moe.slots_per_expert") == (
      "moved to model.moe.layer_options.slots_per_expert")
  peer = MoEConfig(kind="peer")
  with pytest.raises(ConfigError, match="Fix: moved to layer_options.top_k$"):
    apply_overrides(peer, {"topology.peer_top_k": 2})
  assert apply_overrides(peer, {"layer_options.top_k": 2}).layer_options.top_k == 2


def test_the_command_line_can_switch_the_kind_and_set_its_options():
  """--config.model.moe.kind=peer --config.model.moe.layer_options.num_keys=8 on a
  file naming the sparse kind (the tree carries every kind's options at their defaults)."""
  tree = experiment_config_dict(model=dict(moe=dict(kind="sparse")))
  assert tree.model.moe.layer_options.num_keys == 32  # PEER's default, overridable
  tree.model.moe.kind = "peer"
  tree.model.moe.layer_options.num_keys = 8
  moe = experiment_from_dict(tree).model.moe
  assert moe.layer_options == PeerOptions(num_keys=8)
  assert isinstance(tree, ml_collections.ConfigDict)


def test_a_config_rebuilt_as_another_kind_takes_that_kinds_options():
  from moejax.interop import families  # pylint: disable=g-import-not-at-top
  out = families.compose(MoEConfig(kind="peer"), {"num_experts": 4}, {"top_k": 2})
  assert out.kind == "sparse" and to_dict(out.layer_options) == {}
