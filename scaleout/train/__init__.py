"""``scaleout train``: the trainer (trainer.py) and what it trains (tasks.py)."""

from scaleout.train.trainer import Trainer, TrainResult, run_training

__all__ = ["Trainer", "TrainResult", "run_training"]
