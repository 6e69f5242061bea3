"""moejax.train: configs, optimizer, the functional train step, checkpoints, the loop.

``moejax.train.loop.train(cfg, workdir)`` runs one experiment; the absl
binary ``python -m experiments.train`` wraps it.
"""

from moejax.train.config import ExperimentConfig, TrainConfig, experiment_from_dict
from moejax.train.optim import learning_rate_schedule, make_optimizer

__all__ = ["ExperimentConfig", "TrainConfig", "experiment_from_dict", "learning_rate_schedule",
           "make_optimizer"]
