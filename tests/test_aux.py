"""The one typed aux of every MoE layer kind (moejax.balance.aux).

Each kind returns a MoEAux with exactly the fields it declares (its
``aux_fields``; the others None) and a LayerMetrics with exactly its declared
``metric_fields``; the
expert-parallel out_specs and the train step's metric table come from the
types, so a field added to a type shows up in both.
"""

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import pytest
from flax import struct
from jax.sharding import PartitionSpec as P

from moejax import layer as L
from moejax.ablation import runner
from moejax.balance.aux import TOKENS, LayerMetrics, MoEAux, aux_field, metric_field
from moejax.config.registry import LAYERS
from moejax.train import step as step_lib
from tests.configs import moe_config

D = 8
CFGS = {
    "sparse": lambda: moe_config(num_experts=4, expert_width=6, routing=dict(top_k=2),
                                 capacity_factor=1.0),
    "soft": lambda: moe_config("soft", num_experts=2, expert_width=6, slots_per_expert=2),
    "peer": lambda: moe_config("peer", peer_num_keys=4, peer_heads=2, peer_top_k=2,
                               peer_key_dim=4),
}
KINDS = tuple(CFGS)
SPARSE, SOFT, PEER = (LAYERS.get(k) for k in KINDS)


def _layer_aux(kind):
  cfg = CFGS[kind]()
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, D))
  return L.moe_layer(params, x, None, cfg)[1]


@pytest.mark.parametrize("name", KINDS)
def test_every_kind_returns_the_one_type_with_its_declared_fields(name):
  aux, kind = _layer_aux(name), LAYERS.get(name)
  assert type(aux) is MoEAux and type(aux.metrics) is LayerMetrics
  assert tuple(aux.present()) == MoEAux.fields_of(kind)
  for field in set(MoEAux.field_names()) - set(MoEAux.fields_of(kind)):
    assert getattr(aux, field) is None, field
  assert tuple(aux.metrics.present()) == LayerMetrics.fields_of(kind)
  for field in set(LayerMetrics.field_names()) - set(LayerMetrics.fields_of(kind)):
    assert getattr(aux.metrics, field) is None, field
  assert "total" in aux.losses


def test_declarations():
  assert MoEAux.fields_of(SPARSE) == tuple(n for n in MoEAux.field_names() if n != "kind_aux")
  assert MoEAux.fields_of(SOFT) == MoEAux.fields_of(PEER) == ("losses", "metrics")
  assert LayerMetrics.fields_of(PEER) == ("max_vio", "load_entropy", "experts_touched",
                                          "key_max_vio", "key_entropy")
  with pytest.raises(ValueError, match="is not a layer kind"):
    MoEAux.fields_of("dense")

  class Typo(L.LayerKind):
    name = "typo"
    metric_fields = ("max_vio", "maxvio")

  with pytest.raises(ValueError, match=r"metric_fields names \['maxvio'\], not fields"):
    LayerMetrics.fields_of(Typo())


def test_a_kind_of_its_own_declares_its_fields_and_its_aux_type():

  @struct.dataclass
  class MixAux:
    gate_entropy: Any

  class Mix(L.LayerKind):
    name = "mix_for_the_test"  # never registered: the aux asks the object, not a table
    aux_fields = ("losses", "metrics", "kind_aux")
    metric_fields = ("load",)
    Aux = MixAux

  m = LayerMetrics(load=jnp.ones(2))
  aux = MoEAux.for_kind(Mix(), losses={"total": jnp.zeros(())}, metrics=m,
                        kind_aux=MixAux(gate_entropy=jnp.ones(())))
  assert MoEAux.out_specs(P("expert"), Mix()).present() == {
      "losses": P(), "metrics": P(), "kind_aux": P()}
  assert jax.tree.leaves(aux.kind_aux) == [jnp.ones(())]  # a pytree like the rest
  with pytest.raises(ValueError, match="kind_aux is a dict, not the kind's Aux"):
    MoEAux.for_kind(Mix(), losses={"total": jnp.zeros(())}, metrics=m, kind_aux={"e": 1.0})
  with pytest.raises(ValueError, match=r"declared fields \['kind_aux'\] missing"):
    MoEAux.for_kind(Mix(), losses={"total": jnp.zeros(())}, metrics=m)


def test_for_kind_rejects_missing_and_undeclared_fields():
  m = LayerMetrics(max_vio=jnp.zeros(()), load_entropy=jnp.zeros(()),
                   experts_touched=jnp.zeros(()), key_max_vio=jnp.zeros(()),
                   key_entropy=jnp.zeros(()))
  MoEAux.for_kind(PEER, losses={"total": jnp.zeros(())}, metrics=m)
  with pytest.raises(ValueError, match=r"undeclared fields \['load'\]"):
    MoEAux.for_kind(PEER, losses={"total": jnp.zeros(())}, metrics=m, load=jnp.zeros(4))
  with pytest.raises(ValueError, match=r"missing"):
    MoEAux.for_kind(SPARSE, losses={"total": jnp.zeros(())}, metrics=m)
  with pytest.raises(ValueError, match="LayerMetrics of a 'soft' layer"):
    MoEAux.for_kind(SOFT, losses={"total": jnp.zeros(())}, metrics=m)


def test_out_specs_derive_from_the_type():
  tok = P(("data", "fsdp", "expert"))
  specs = MoEAux.out_specs(tok, SPARSE)
  assert specs.routing == tok and specs.selection == tok  # token-major
  assert specs.kind_aux is None  # the shipped sparse kind has no aux of its own
  for name in set(MoEAux.field_names()) - {"routing", "selection", "kind_aux"}:
    assert getattr(specs, name) == P(), name
  soft = MoEAux.out_specs(tok, SOFT)
  assert soft.present() == {"losses": P(), "metrics": P()}
  # The specs are a pytree prefix of the layer's aux (what shard_map needs).
  aux = _layer_aux("sparse")
  jax.tree.map(lambda spec, sub: None, specs, aux, is_leaf=lambda v: isinstance(v, P))


def test_a_field_added_to_the_type_appears_in_out_specs():

  @struct.dataclass
  class Wider(MoEAux):
    per_token: Optional[Any] = aux_field(ep=TOKENS)
    global_count: Optional[Any] = aux_field()

  class WiderSparse(L.SparseKind):
    aux_fields = L.SparseKind.aux_fields + ("per_token", "global_count")

  class WiderSoft(L.SoftKind):
    aux_fields = L.SoftKind.aux_fields + ("global_count",)

  tok = P("expert")
  specs = Wider.out_specs(tok, WiderSparse())
  assert specs.per_token == tok and specs.global_count == P()
  assert Wider.out_specs(tok, WiderSoft()).per_token is None
  assert Wider.out_specs(tok, WiderSoft()).global_count == P()


def test_reduce_on_exit_averages_only_the_declared_fields():
  aux = _layer_aux("sparse")
  out = aux.reduce_on_exit(lambda v: v + 1)
  assert float(out.losses["total"]) == float(aux.losses["total"]) + 1
  assert out.load is aux.load and out.metrics is aux.metrics


def test_the_metric_tables_derive_from_the_type():
  assert step_lib._MOE_METRICS == LayerMetrics.logged()
  logged = dict(LayerMetrics.logged())
  for f in dataclasses.fields(LayerMetrics):
    if f.metadata["summary"]:
      assert f.metadata["log"] in runner.SUMMARIZED_TRAIN_METRICS
  # The series the runner summarises are the ones it summarised before the types.
  assert set(runner.SUMMARIZED_TRAIN_METRICS) == {
      "max_vio_batch", "drop_rate", "active_experts_mean", "active_experts_var",
      "load_entropy", "soft_dispatch_entropy", "soft_combine_entropy",
      "peer_experts_touched", "peer_key_max_vio", "mod_capacity_use",
      "mod_causal_agreement"}
  # routing_summary logs exactly the declared, present metrics' names.
  for name in KINDS:
    metrics = _layer_aux(name).metrics
    summary = step_lib.routing_summary({"moe": {"layer_0": {"metrics": metrics}}, "mod": {}})
    assert set(summary) == {logged[n] for n in LayerMetrics.fields_of(LAYERS.get(name))
                            if n in logged}


def test_a_metric_added_to_the_type_is_logged():

  @struct.dataclass
  class More(LayerMetrics):
    new_stat: Optional[Any] = metric_field(log="soft_new_stat", summary=True)

  class MoreSoft(L.SoftKind):
    metric_fields = L.SoftKind.metric_fields + ("new_stat",)

  assert ("new_stat", "soft_new_stat") in More.logged()
  assert "soft_new_stat" in More.summarized()
  assert More.fields_of(MoreSoft())[-1] == "new_stat"
