"""``scaleout train``: the trainer (loop.py) and what it trains (tasks.py)."""

from scaleout.train.loop import Trainer, TrainResult, run_training

__all__ = ["Trainer", "TrainResult", "run_training"]
