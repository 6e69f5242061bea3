"""Layer configs for tests: flat topology fields plus the plane sections.

``moe_config(num_experts=4, expert_width=6, routing=dict(top_k=2),
balance=dict(aux_loss_coef=1e-2))`` builds the same MoEConfig as the
sectioned tree ``{'topology': {...}, 'routing': {...}, 'balance': {...}}``;
``capacity_factor`` / ``drop_priority`` go to balance and ``backend`` /
``interpret`` to execution, and a layer kind's options may be given by their
old flat names (``slots_per_expert``, ``peer_num_keys``, ...; the table of
relocated keys, ``moejax.config.core.RELOCATED``) into ``layer_options``, so
tiny hand-made cases stay one line.
"""

from __future__ import annotations

import dataclasses

from moejax.config import MoEConfig, RoutingConfig, TopologyConfig, from_dict
from moejax.config.core import RELOCATED

_TOPOLOGY = {f.name for f in dataclasses.fields(TopologyConfig)}
# Old flat topology name -> the layer kind's option (moe.layer_options.<name>).
_LAYER_OPTIONS = {old: new for (cls, old), (sibling, new) in RELOCATED.items()
                  if cls == "TopologyConfig" and sibling == "layer_options"}
_SECTION = {"capacity_factor": "balance", "drop_priority": "balance", "backend": "execution",
            "interpret": "execution"}


def moe_config(kind: str = "sparse", *, routing=None, balance=None, execution=None,
               **flat) -> MoEConfig:
  tree = {"kind": kind, "topology": {}, "routing": routing or {}, "balance": balance or {},
          "execution": execution or {}}
  for section in ("routing", "balance", "execution"):
    if isinstance(tree[section], dict):
      tree[section] = dict(tree[section])
  # A router's own fields may be given flat (routing=dict(kind='top_p', top_p=0.5)):
  # they move into routing.options, as RoutingConfig.build does.
  own = {f.name for f in dataclasses.fields(RoutingConfig)}
  extra = {k: tree["routing"].pop(k) for k in list(tree["routing"]) if k not in own} if (
      isinstance(tree["routing"], dict)) else {}
  if extra:
    tree["routing"]["options"] = {**(tree["routing"].get("options") or {}), **extra}
  for key, value in flat.items():
    if key in _TOPOLOGY:
      tree["topology"][key] = value
    elif key in _LAYER_OPTIONS:
      tree.setdefault("layer_options", {})[_LAYER_OPTIONS[key]] = value
    elif key in _SECTION:
      section = tree[_SECTION[key]]
      if not isinstance(section, dict):  # a built section: replace one field
        tree[_SECTION[key]] = dataclasses.replace(section, **{key: value})
      else:
        section[key] = value
    else:
      raise TypeError(f"moe_config: {key!r} is not a topology field or a section shortcut")
  return from_dict(MoEConfig, tree)


def replace_moe(cfg: MoEConfig, **flat) -> MoEConfig:
  """``cfg`` with flat topology fields (and the section shortcuts) replaced."""
  sections = {}
  for key, value in flat.items():
    if key in _LAYER_OPTIONS:
      sections.setdefault("layer_options", {})[_LAYER_OPTIONS[key]] = value
      continue
    section = "topology" if key in _TOPOLOGY else _SECTION.get(key)
    if section is None:
      raise TypeError(f"replace_moe: {key!r} is not a topology field or a section shortcut")
    sections.setdefault(section, {})[key] = value
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields)
                                     for name, fields in sections.items()})
