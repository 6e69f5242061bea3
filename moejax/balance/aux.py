"""The typed aux of one MoE layer (:class:`MoEAux`) and its metrics (:class:`LayerMetrics`).

Legend: T tokens, K slots per token, E FFN experts, E_r = E + Z router outputs.

Every layer kind (the shipped ``sparse``, ``soft``, ``peer`` and a plugin's
own) returns one :class:`MoEAux`. The kind declares which fields it fills
(``aux_fields`` and ``metric_fields`` of :class:`moejax.layer.LayerKind`);
the others are ``None`` (explicitly absent). :meth:`MoEAux.for_kind` builds
an aux and checks that exactly the declared fields are present. A kind's own
aux, beyond the shared fields, is ``kind_aux``: an instance of the kind's
``Aux`` type (a ``flax.struct`` dataclass, immutable and a pytree like the
rest). Each field of the two types declares, in its metadata:

- ``ep``: how it leaves the expert-parallel layer's ``shard_map``:
  ``REPLICATED`` (reduced over the mesh inside the layer, the same on every
  device: ``P()``) or ``TOKENS`` (token-major, split like the tokens). The
  expert-parallel layer's ``out_specs`` is :meth:`MoEAux.out_specs`;
- ``reduce``: ``'pmean'`` when the field is a per-device value the
  expert-parallel layer averages over the mesh on exit (batch- and
  sequence-scope losses), else None (already global).

:class:`LayerMetrics` fields declare ``log``: the
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

REPLICATED, TOKENS = "replicated", "tokens"


def aux_field(*, ep: str = REPLICATED, reduce: Optional[str] = None):
  """A :class:`MoEAux` field, leaving shard_map as ``ep``."""
  if ep not in (REPLICATED, TOKENS):
    raise ValueError(f"aux_field: ep={ep!r}; expected {REPLICATED!r} or {TOKENS!r}")
  return struct.field(default=None, metadata={"ep": ep, "reduce": reduce})


def metric_field(*, log: Optional[str] = None, summary: bool = False):
  """A :class:`LayerMetrics` field, logged by the train step as ``log``."""
  if summary and log is None:
    raise ValueError("metric_field: summary=True needs a log name")
  return struct.field(default=None, metadata={"log": log, "summary": summary})


def _declared(cls, kind: Any) -> tuple[str, ...]:
  """What ``kind`` (a LayerKind) declares it fills of ``cls`` (``aux_fields`` /
  ``metric_fields``); a name the type does not have is an error."""
  attr = cls._declared_by
  names = getattr(kind, attr, None)
  if names is None:
    raise ValueError(f"{cls.__name__}: {kind!r} is not a layer kind (it has no {attr}). "
                     "Fix: pass the registered kind object (cfg.layer)")
  unknown = set(names) - set(cls.field_names())
  if unknown:
    raise ValueError(f"layer kind {kind.name!r}: {attr} names {sorted(unknown)}, not fields "
                     f"of {cls.__name__} (its fields: {', '.join(cls.field_names())}). Fix: "
                     "declare only these; a kind's own values go in its Aux (kind_aux)")
  return tuple(names)


class _Declared:
  """Per-kind field declarations shared by the two types."""

  _declared_by = ""  # the LayerKind attribute that lists the fields it fills

  @classmethod
  def field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))

  @classmethod
  def fields_of(cls, kind: Any) -> tuple[str, ...]:
    """The fields layers of ``kind`` (a LayerKind) fill, in the type's order (the others
    are None)."""
    declared = set(_declared(cls, kind))
    return tuple(n for n in cls.field_names() if n in declared)

  def present(self) -> dict[str, Any]:
    """``{field: value}`` of the fields that are not None, in declaration order."""
    return {n: getattr(self, n) for n in self.field_names() if getattr(self, n) is not None}

  def check_kind(self, kind: Any, allow_missing: tuple[str, ...] = ()) -> None:
    """Raises unless exactly the fields declared for ``kind`` are present."""
    want = set(self.fields_of(kind))
    have = set(self.present())
    extra, missing = have - want, want - have - set(allow_missing)
    if extra or missing:
      raise ValueError(f"{type(self).__name__} of a {kind.name!r} layer: undeclared fields "
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

  Which of them a layer fills is its kind's ``metric_fields``.
  """

  _declared_by = "metric_fields"

  load: Optional[jax.Array] = metric_field()
  max_vio: Optional[jax.Array] = metric_field(log="max_vio_batch", summary=True)
  load_entropy: Optional[jax.Array] = metric_field(log="load_entropy", summary=True)
  active_mean: Optional[jax.Array] = metric_field(log="active_experts_mean", summary=True)
  active_var: Optional[jax.Array] = metric_field(log="active_experts_var", summary=True)
  active_over_max: Optional[jax.Array] = metric_field(log="active_experts_over_max")
  zero_compute_fraction: Optional[jax.Array] = metric_field()
  coactivation: Optional[jax.Array] = metric_field()
  drop_rate: Optional[jax.Array] = metric_field(log="drop_rate", summary=True)
  dispatch_entropy: Optional[jax.Array] = metric_field(log="soft_dispatch_entropy", summary=True)
  combine_entropy: Optional[jax.Array] = metric_field(log="soft_combine_entropy", summary=True)
  experts_touched: Optional[jax.Array] = metric_field(log="peer_experts_touched", summary=True)
  key_max_vio: Optional[jax.Array] = metric_field(log="peer_key_max_vio", summary=True)
  key_entropy: Optional[jax.Array] = metric_field(log="peer_key_entropy")

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
    kind_aux: the layer kind's own aux, an instance of its ``Aux`` (a
      ``flax.struct`` dataclass); for kinds that declare one (none shipped).

  Which of them a layer fills is its kind's ``aux_fields``.
  """

  _declared_by = "aux_fields"

  losses: Optional[Mapping[str, jax.Array]] = aux_field(reduce="pmean")
  metrics: Optional[LayerMetrics] = aux_field()
  load: Optional[jax.Array] = aux_field()
  router_load: Optional[jax.Array] = aux_field()
  num_dropped: Optional[jax.Array] = aux_field()
  routing: Optional[RoutingResult] = aux_field(ep=TOKENS)
  selection: Optional[Any] = aux_field(ep=TOKENS)
  execution: Optional[Mapping[str, Any]] = aux_field()
  observed: Optional[Mapping[str, Any]] = aux_field()
  kind_aux: Optional[Any] = aux_field()

  @classmethod
  def for_kind(cls, kind: Any, **fields) -> "MoEAux":
    """The aux of a layer of ``kind`` (a LayerKind); raises unless ``fields`` are exactly
    its declared ones.

    The metrics are checked against ``kind`` too, and ``kind_aux`` is an
    instance of the kind's ``Aux``.
    """
    aux = cls(**fields)
    aux.check_kind(kind)
    aux.metrics.check_kind(kind)
    own = getattr(kind, "Aux", None)
    if aux.kind_aux is not None and (own is None or type(aux.kind_aux) is not own):
      raise ValueError(f"MoEAux of a {kind.name!r} layer: kind_aux is a "
                       f"{type(aux.kind_aux).__name__}, not the kind's Aux ({own!r}). Fix: "
                       "set Aux on the kind to the struct dataclass its layer returns")
    return aux

  @classmethod
  def out_specs(cls, token_spec: Any, kind: Any) -> "MoEAux":
    """The ``shard_map`` out_specs of the aux of a layer of ``kind`` (a LayerKind): each
    declared field's ``ep``.

    ``P()`` for replicated fields, ``token_spec`` for token-major ones, None
    for the fields the kind leaves absent.
    """
    declared = set(cls.fields_of(kind))
    return cls(**{f.name: (token_spec if f.metadata["ep"] == TOKENS else P())
                  for f in dataclasses.fields(cls) if f.name in declared})

  def reduce_on_exit(self, pmean: Callable[[jax.Array], jax.Array]) -> "MoEAux":
    """The aux with ``pmean`` applied to every leaf of the fields declared ``reduce='pmean'``."""
    return self.replace(**{f.name: jax.tree.map(pmean, getattr(self, f.name))
                           for f in dataclasses.fields(self)
                           if f.metadata["reduce"] == "pmean"})
