"""The typed aux of one MoE layer (:class:`MoEAux`) and its metrics (:class:`LayerMetrics`).

Legend: T tokens, K slots per token, E FFN experts, E_r = E + Z router outputs.

Every layer kind (``'sparse'``, ``'soft'``, ``'peer'``) returns one
:class:`MoEAux`. Each field declares, in its metadata:

- ``kinds``: the layer kinds that fill it; for the others it is ``None``
  (explicitly absent). :meth:`MoEAux.for_kind` builds an aux and checks that
  exactly the declared fields are present;
- ``ep``: how it leaves the expert-parallel layer's ``shard_map``:
  ``REPLICATED`` (reduced over the mesh inside the layer, the same on every
  device: ``P()``) or ``TOKENS`` (token-major, split like the tokens). The
  expert-parallel layer's ``out_specs`` is :meth:`MoEAux.out_specs`;
- ``reduce``: ``'pmean'`` when the field is a per-device value the
  expert-parallel layer averages over the mesh on exit (batch- and
  sequence-scope losses), else None (already global).

:class:`LayerMetrics` fields declare their ``kinds`` too, and ``log``: the
name under which the train step logs their mean over layers (None: not
logged), and ``summary``: whether the ablation runner summarises that logged
series. The train step's metric table is :meth:`LayerMetrics.logged`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
from flax import struct
from jax.sharding import PartitionSpec as P

from moejax.routing.types import RoutingResult

KINDS = ("sparse", "soft", "peer")
REPLICATED, TOKENS = "replicated", "tokens"
_ALL = KINDS


def aux_field(kinds=_ALL, *, ep: str = REPLICATED, reduce: Optional[str] = None):
  """A :class:`MoEAux` field filled by ``kinds``, leaving shard_map as ``ep``."""
  if ep not in (REPLICATED, TOKENS):
    raise ValueError(f"aux_field: ep={ep!r}; expected {REPLICATED!r} or {TOKENS!r}")
  bad = set(kinds) - set(KINDS)
  if bad:
    raise ValueError(f"aux_field: unknown layer kinds {sorted(bad)}; known {KINDS}")
  return struct.field(default=None, metadata={"kinds": tuple(kinds), "ep": ep,
                                              "reduce": reduce})


def metric_field(kinds=_ALL, *, log: Optional[str] = None, summary: bool = False):
  """A :class:`LayerMetrics` field filled by ``kinds``, logged by the train step as ``log``."""
  bad = set(kinds) - set(KINDS)
  if bad:
    raise ValueError(f"metric_field: unknown layer kinds {sorted(bad)}; known {KINDS}")
  if summary and log is None:
    raise ValueError("metric_field: summary=True needs a log name")
  return struct.field(default=None, metadata={"kinds": tuple(kinds), "log": log,
                                              "summary": summary})


def _check_kind(kind: str, where: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"{where}: unknown layer kind {kind!r}; known {KINDS}")


class _Declared:
  """Per-kind field declarations shared by the two types."""

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def fields_of(cls, kind: str) -> tuple[str, ...]:
    """The fields layers of ``kind`` fill (the others are None)."""
    _check_kind(kind, f"{cls.__name__}.fields_of")
    return tuple(f.name for f in dataclasses.fields(cls) if kind in f.metadata["kinds"])

  def present(self) -> dict[str, Any]:
    """``{field: value}`` of the fields that are not None, in declaration order."""
    return {n: getattr(self, n) for n in self.field_names() if getattr(self, n) is not None}

  def check_kind(self, kind: str, allow_missing: tuple[str, ...] = ()) -> None:
    """Raises unless exactly the fields declared for ``kind`` are present."""
    want = set(self.fields_of(kind))
    have = set(self.present())
    extra, missing = have - want, want - have - set(allow_missing)
    if extra or missing:
      raise ValueError(f"{type(self).__name__} of a {kind!r} layer: undeclared fields "
                       f"{sorted(extra)} present, declared fields {sorted(missing)} missing")


@struct.dataclass
class LayerMetrics(_Declared):
  """Routing metrics of one MoE layer (see :mod:`moejax.balance.metrics`); scalars f32[].

  Attributes:
    load: f32[E] token copies per FFN expert (sparse: the router's decision
      before capacity; soft: the combine mass per expert).
    max_vio: MaxVio_batch of the load (PEER: of the retrievals per expert).
    load_entropy: entropy of the load / log E, in [0, 1].
    active_mean / active_var: FFN experts computed per token (kept copies).
    active_over_max: share of tokens whose decision holds more FFN experts
      than the router declares at most (``RouterSpec.slots``); 0 for a router
      that keeps its word (the ablation runner fails a run where it is not).
    zero_compute_fraction: share of valid slots on zero-computation experts.
    coactivation: f32[E, E] tokens routed to both experts.
    drop_rate: share of the FFN copies capacity removed (None when
      :func:`~moejax.balance.metrics.routing_metrics` got no ``dropped``).
    dispatch_entropy / combine_entropy: Soft MoE slot / token mixture entropies.
    experts_touched / key_max_vio / key_entropy: PEER retrieval coverage and
      sub-key balance.
  """

  load: Optional[jax.Array] = metric_field(("sparse", "soft"))
  max_vio: Optional[jax.Array] = metric_field(log="max_vio_batch", summary=True)
  load_entropy: Optional[jax.Array] = metric_field(log="load_entropy", summary=True)
  active_mean: Optional[jax.Array] = metric_field(("sparse",), log="active_experts_mean",
                                                  summary=True)
  active_var: Optional[jax.Array] = metric_field(("sparse",), log="active_experts_var",
                                                 summary=True)
  active_over_max: Optional[jax.Array] = metric_field(("sparse",),
                                                      log="active_experts_over_max")
  zero_compute_fraction: Optional[jax.Array] = metric_field(("sparse",))
  coactivation: Optional[jax.Array] = metric_field(("sparse",))
  drop_rate: Optional[jax.Array] = metric_field(("sparse",), log="drop_rate", summary=True)
  dispatch_entropy: Optional[jax.Array] = metric_field(("soft",), log="soft_dispatch_entropy",
                                                       summary=True)
  combine_entropy: Optional[jax.Array] = metric_field(("soft",), log="soft_combine_entropy",
                                                      summary=True)
  experts_touched: Optional[jax.Array] = metric_field(("peer",), log="peer_experts_touched",
                                                      summary=True)
  key_max_vio: Optional[jax.Array] = metric_field(("peer",), log="peer_key_max_vio",
                                                  summary=True)
  key_entropy: Optional[jax.Array] = metric_field(("peer",), log="peer_key_entropy")

  @classmethod
  def logged(cls) -> tuple[tuple[str, str], ...]:
    """``(field, logged name)`` of every field the train step logs (mean over layers)."""
    return tuple((f.name, f.metadata["log"]) for f in dataclasses.fields(cls)
                 if f.metadata["log"] is not None)

  @classmethod
  def summarized(cls) -> tuple[str, ...]:
    """Logged names the ablation runner summarises from the training log."""
    return tuple(f.metadata["log"] for f in dataclasses.fields(cls) if f.metadata["summary"])


@struct.dataclass
class MoEAux(_Declared):
  """What one MoE layer returns besides y; an immutable pytree.

  Attributes:
    losses: ``{name: f32[]}`` weighted balance / z losses with ``total`` (what
      the trainer adds to the objective); every kind (``{'total': 0}`` when
      the kind has none).
    metrics: :class:`LayerMetrics`; every kind.
    load: f32[E] token copies the router sent to each FFN expert (before
      capacity, summed over the layer's ``axis_names``); sparse only.
    router_load: f32[E_r] the same over every router output (the bias
      controller's input); sparse only.
    num_dropped: int32[] copies capacity removed (summed); sparse only.
    routing: the :class:`RoutingResult` after capacity, token-major; sparse only.
    selection: the router's selection before capacity, token-major
      (:class:`moejax.routing.replay.RoutingReplay`: expert_ids, valid), what
      routing replay records and replays; sparse only.
    execution: the executor's extras (empty on one device; expert-parallel:
      ``device_load`` f32[D] and ``comm``); sparse only.
    observed: ``{idea: {name: f32}}`` what the config's stateful ideas observed
      (sums over the batch, the same on every device; :mod:`moejax.routing.state`),
      the input of their once-per-step update; sparse only.
  """

  losses: Optional[Mapping[str, jax.Array]] = aux_field(reduce="pmean")
  metrics: Optional[LayerMetrics] = aux_field()
  load: Optional[jax.Array] = aux_field(("sparse",))
  router_load: Optional[jax.Array] = aux_field(("sparse",))
  num_dropped: Optional[jax.Array] = aux_field(("sparse",))
  routing: Optional[RoutingResult] = aux_field(("sparse",), ep=TOKENS)
  selection: Optional[Any] = aux_field(("sparse",), ep=TOKENS)
  execution: Optional[Mapping[str, Any]] = aux_field(("sparse",))
  observed: Optional[Mapping[str, Any]] = aux_field(("sparse",))

  @classmethod
  def for_kind(cls, kind: str, **fields) -> "MoEAux":
    """The aux of a ``kind`` layer; raises unless ``fields`` are exactly its declared ones.

    The metrics are checked against ``kind`` too.
    """
    _check_kind(kind, "MoEAux.for_kind")
    aux = cls(**fields)
    aux.check_kind(kind)
    aux.metrics.check_kind(kind)
    return aux

  @classmethod
  def out_specs(cls, token_spec: Any, kind: str = "sparse") -> "MoEAux":
    """The ``shard_map`` out_specs of a ``kind`` layer's aux: each declared field's ``ep``.

    ``P()`` for replicated fields, ``token_spec`` for token-major ones, None
    for the fields the kind leaves absent.
    """
    specs = {f.name: (token_spec if f.metadata["ep"] == TOKENS else P())
             for f in dataclasses.fields(cls) if kind in f.metadata["kinds"]}
    _check_kind(kind, "MoEAux.out_specs")
    return cls(**specs)

  def reduce_on_exit(self, pmean: Callable[[jax.Array], jax.Array]) -> "MoEAux":
    """The aux with ``pmean`` applied to every leaf of the fields declared ``reduce='pmean'``."""
    return self.replace(**{f.name: jax.tree.map(pmean, getattr(self, f.name))
                           for f in dataclasses.fields(self)
                           if f.metadata["reduce"] == "pmean"})
