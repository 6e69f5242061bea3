"""A layer kind from outside the package: every token mixes all E experts by a softmax gate.

The dense mixture of experts (Jacobs et al. 1991): no routing, no capacity,
no dropping; the output is sum_e g_e(x) FFN_e(x) with g = softmax(x W / tau).
What a researcher's own layer kind looks like: a ``LayerKind`` with a
``name``, its ``Options`` (``moe.layer_options``), the aux it fills
(``aux_fields``, ``metric_fields``) and its own ``Aux``, its parameters
(``init``), its forward (``apply``) and its accounting (``components``),
registered with ``register_kind``; a config names it in ``moe.kind``.
Legend: T tokens, d width, E experts, f expert width.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from moejax.balance import metrics as metrics_lib
from moejax.balance import stats
from moejax.balance.aux import LayerMetrics, MoEAux
from moejax.config import ConfigError
from moejax.config.core import check_positive
from moejax.layer import LayerKind, register_kind
from moejax.topology.accounting import Component, ffn_params


@dataclasses.dataclass(frozen=True)
class DenseMixOptions:
  """``moe.layer_options`` of ``moe.kind='dense_mix'``: the gate's softmax temperature."""

  temperature: float = 1.0

  def __post_init__(self):
    check_positive("moe.layer_options.temperature", self.temperature)


@struct.dataclass
class DenseMixAux:
  """What only this kind reports: f32[] mean over tokens of the gate's entropy / log E."""

  gate_entropy: jax.Array


class DenseMixKind(LayerKind):
  """Every expert on every token, weighted by a learned softmax gate."""

  name = "dense_mix"
  honoured = {"topology": {"num_experts", "expert_width", "activation", "derived_from"},
              "routing": set(), "balance": set(), "execution": set()}
  why = ("a dense mixture runs every expert on every token: it has no routing, balance "
         "loss, capacity or grouped-matmul backend")
  routing_fix = "a dense mixture has no router to replace"
  segmentable = False
  why_not_segmentable = "the test kind keeps its experts whole"
  Options = DenseMixOptions
  metric_fields = ("load", "max_vio", "load_entropy")
  aux_fields = ("losses", "metrics", "kind_aux")
  Aux = DenseMixAux

  def check(self, cfg):
    if cfg.topology.activation != "swiglu":
      raise ConfigError("moe.topology.activation", cfg.topology.activation,
                        "dense_mix builds SwiGLU experts", "set moe.topology.activation='swiglu'")

  def has_router_weights(self, cfg):
    return True

  def components(self, moe, d_model, seq_len):
    del seq_len
    e, f = moe.num_experts, moe.topology.expert_width
    experts = e * ffn_params(d_model, f, "swiglu")
    gate = d_model * e
    return {"routed_experts": Component(experts, experts, experts, 2.0 * experts),
            "router": Component(gate, gate, gate, 2.0 * gate)}

  def init(self, key, d_model, cfg, dtype):
    e, f = cfg.num_experts, cfg.topology.expert_width
    k_gate, k_in, k_up, k_out = jax.random.split(key, 4)
    normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32)
                                       * fan_in ** -0.5).astype(dtype)
    return {"router": {"w": normal(k_gate, (d_model, e), d_model)},
            "experts": {"w_gate": normal(k_in, (e, d_model, f), d_model),
                        "w_up": normal(k_up, (e, d_model, f), d_model),
                        "w_down": normal(k_out, (e, f, d_model), f)}}

  def apply(self, params, x, shared_x, state, cfg, *, axis_names, **_):
    logits = x.astype(jnp.float32) @ params["router"]["w"].astype(jnp.float32)  # [T, E]
    gate = jax.nn.softmax(logits / cfg.layer_options.temperature, axis=-1)
    w = params["experts"]
    h = jax.nn.silu(jnp.einsum("td,edf->etf", x, w["w_gate"])) * jnp.einsum(
        "td,edf->etf", x, w["w_up"])
    out = jnp.einsum("etf,efd->etd", h, w["w_down"])                          # [E, T, d]
    y = jnp.einsum("te,etd->td", gate.astype(out.dtype), out)
    load = stats.psum(jnp.sum(gate, axis=0), axis_names)                      # [E]
    tokens = stats.psum(jnp.asarray(x.shape[0], jnp.float32), axis_names)
    entropy = -jnp.sum(gate * jnp.log(jnp.maximum(gate, 1e-30)), axis=-1)
    mean_entropy = stats.psum(jnp.sum(entropy), axis_names) / tokens / jnp.log(gate.shape[-1])
    metrics = LayerMetrics(load=load, max_vio=metrics_lib.max_vio(load),
                           load_entropy=metrics_lib.load_entropy(load))
    return y, MoEAux.for_kind(self, losses={"total": jnp.zeros((), jnp.float32)},
                              metrics=metrics, kind_aux=DenseMixAux(gate_entropy=mean_entropy))


register_kind(DenseMixKind())
