"""Typed, frozen configuration for moejax, validated before any compute.

The tree mirrors the planes (docs/design.md)::

    model: ModelConfig                     moejax.config.model
      moe: MoEConfig                       moejax.config.moe
        kind
        topology: TopologyConfig           which experts exist
        routing: RoutingConfig             which experts a token uses
        balance: BalanceConfig             losses, bias controller, capacity
        execution: ExecutionConfig         how experts are computed
    parallel: ParallelConfig               moejax.config.parallel
    data: DataConfig, train: TrainConfig   moejax.data.config, moejax.train.config

Names a field may take live in :mod:`moejax.config.registry`; cross-section
rules are the named functions of :mod:`moejax.config.rules`. Every failure
is a :class:`ConfigError` naming the dotted field, the value and a fix.
"""

from moejax.config.architecture import ArchitectureConfig
from moejax.config.core import (MOVED, ConfigError, apply_overrides, check_choice, check_count,
                                check_fraction, check_number, check_positive, from_dict,
                                moved_hint, parse_scalar, to_dict, unwrap_optional)
from moejax.config.model import ModelConfig
from moejax.config.moe import (BalanceConfig, ExecutionConfig, MoEConfig, RoutingConfig,
                               TopologyConfig)
from moejax.config.parallel import (ParallelConfig, check_experts, check_route_limit,
                                    resolve_route_limit)
from moejax.config.registry import *  # noqa: F401,F403  (the name registries)
from moejax.config import files
from moejax.config.segmentation import deepseekmoe, fine_grain

__all__ = [
    "ArchitectureConfig", "BalanceConfig", "files", "ConfigError", "ExecutionConfig", "MOVED",
    "MoEConfig", "ModelConfig", "ParallelConfig", "RoutingConfig", "TopologyConfig",
    "apply_overrides", "check_choice", "check_count", "check_experts", "check_fraction",
    "check_number", "check_positive", "check_route_limit", "deepseekmoe", "fine_grain",
    "from_dict", "moved_hint", "parse_scalar", "resolve_route_limit", "to_dict",
    "unwrap_optional",
]
