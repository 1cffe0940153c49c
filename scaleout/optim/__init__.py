"""Large-batch optimizers: LAMB and LARS with the MLPerf rules, a sharded LAMB, and their schedule.

    from scaleout.optim import build_optimizer, build_schedule
    opt = build_optimizer(model, cfg.optim, world)     # LAMB / LARS / ShardedLAMB / AdamW / SGD
    sched = build_schedule(opt, cfg.optim)             # linear warmup, polynomial decay; step() per
    step

See docs/optim.md for the update rules, the groups and the measured speed.
"""

from scaleout.optim import fused  # noqa: F401 -- registers the one-pass ops LAMB/LARS call
from scaleout.optim.base import state_bytes
from scaleout.optim.factory import build_optimizer, build_schedule
from scaleout.optim.groups import param_groups
from scaleout.optim.lamb import LAMB
from scaleout.optim.lars import LARS, LARS_ETA
from scaleout.optim.schedule import WarmupPoly, warmup_poly
from scaleout.optim.sharded import ShardedLAMB

__all__ = [
    "LAMB",
    "LARS",
    "LARS_ETA",
    "ShardedLAMB",
    "param_groups",
    "build_optimizer",
    "build_schedule",
    "WarmupPoly",
    "warmup_poly",
    "state_bytes",
]
