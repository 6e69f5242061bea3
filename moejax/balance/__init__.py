"""The balance (control) plane: losses, the bias controller, capacity, load metrics.

Losses and bias-controller rules are registered objects
(:mod:`moejax.balance.rules`): ``register_loss`` / ``register_bias_rule`` add
one of your own.
"""

from moejax.balance.aux import LayerMetrics, MoEAux
from moejax.balance.capacity import apply_capacity, expert_capacity
from moejax.balance.controller import update_bias
from moejax.balance.losses import (balance_losses, comm_balance_loss, device_balance_loss,
                                   entropy_loss, load_balance_loss, sequence_balance_loss,
                                   z_loss)
from moejax.balance.rules import BalanceLoss, BiasRule, register_bias_rule, register_loss
from moejax.balance import remoe  # noqa: F401  (registers 'remoe_l1')
from moejax.balance.metrics import (MaxVioAccumulator, active_experts, coactivation,
                                    drop_rate, expert_load, load_entropy, max_vio,
                                    routing_metrics)

__all__ = [
    "LayerMetrics", "MoEAux",
    "apply_capacity", "expert_capacity", "update_bias", "balance_losses",
    "comm_balance_loss", "device_balance_loss", "entropy_loss", "load_balance_loss",
    "sequence_balance_loss", "z_loss", "MaxVioAccumulator", "active_experts",
    "coactivation", "drop_rate", "expert_load", "load_entropy", "max_vio",
    "routing_metrics", "BalanceLoss", "BiasRule", "register_bias_rule", "register_loss",
]
