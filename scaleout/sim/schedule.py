"""The training schedule of a planned point: learning rate, warm-up, decay horizon, evaluation
cadence and step cap at the point's global batch, so that the run ``scaleout plan`` prints stops
at the target where the plan predicts, not at the config's own ``train.max_steps``.

Two references, one rule:

- **RCPs** (the config's family has MLPerf reference convergence points): the RCP record nearest
  the batch (log distance) gives the hyper-parameters MLCommons' reference runs used at their
  batch (``Hyperparams`` of ``rcps_<bench>.json``: base learning rate, warm-up, start warm-up step,
  decay horizon, LAMB betas, weight decay). At that record's batch they are taken as they are.
- **The config** (a ``--fit`` curve, or a family without RCPs): the config's own optimizer keys at
  its own global batch.

From the reference batch B_ref to the point's batch B (the LAMB paper's BERT rule, You et al. 2019,
arXiv 1904.00962, sec. 4; the rule ``scaleout bench largebatch`` measures the fit with): the
learning rate x sqrt(B / B_ref) for LAMB and Adam-type optimizers, x B / B_ref for SGD/LARS (Goyal
et al. 2017, arXiv 1706.02677); the same warm-up *steps* (linear-epoch warm-up, arXiv 1901.08256);
the decay horizon keeps the reference's ratio to the samples it needed, i.e. horizon samples x
samples(B) / samples(B_ref); evaluation every MLPerf-rule interval (BERT: scaleout.sim.step's
``mlperf-bert`` rule) or the config's interval in samples. ``train.max_steps`` is the horizon and
never below the predicted steps to the target.

Batches: an RCP's batch is MLPerf's ``global_batch_size`` (sequences); a packed BERT row carries the
packing's integer rate of them (``mlperf_rate``), as the MLPerf log reports it
(scaleout.train.hparams). Pure Python; no torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from scaleout.sim.convergence import DEFAULT_RULESET, RCP_UNITS, ConvergenceCurve, rcp_dir

# Optimizers whose learning rate scales with the square root of the batch (else linearly).
SQRT_SCALED = ("lamb", "adamw")


@dataclass(frozen=True)
class Reference:
    """The hyper-parameters at one batch a schedule is scaled from."""

    batch: float  # in the curve's units (MLPerf sequences for RCPs, config samples for a fit)
    lr: float
    warmup_steps: int
    start_warmup_step: int
    horizon_steps: int  # the decay horizon (optim.total_steps)
    source: str
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None


@dataclass(frozen=True)
class Schedule:
    """The optimizer and train keys of one point; ``overrides()`` are config ``key=value``s."""

    global_batch: int  # train.global_batch (config units: packed rows for packed BERT)
    lr: float
    warmup_steps: int
    start_warmup_step: int
    total_steps: int  # optim.total_steps = train.max_steps
    eval_every: int
    predicted_steps: int  # to the target, a multiple of eval_every
    reference: Reference
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None

    def overrides(self) -> list[str]:
        out = [
            f"optim.lr={self.lr:.6g}",
            f"optim.warmup_steps={self.warmup_steps}",
            f"optim.start_warmup_step={self.start_warmup_step}",
            f"optim.total_steps={self.total_steps}",
            f"train.max_steps={self.total_steps}",
            f"train.eval_every={self.eval_every}",
            "train.eval_start_step=0",
        ]
        if self.betas is not None:
            out.append(f"optim.betas=[{self.betas[0]:g},{self.betas[1]:g}]")
        if self.weight_decay is not None:
            out.append(f"optim.weight_decay={self.weight_decay:g}")
        return out

    def describe(self) -> str:
        return (
            f"{self.predicted_steps} steps predicted to the target (evaluation every "
            f"{self.eval_every}), LR {self.lr:.4g} with {self.warmup_steps} warm-up steps, decay "
            f"over {self.total_steps} = train.max_steps; scaled from {self.reference.source}"
        )


def rcp_references(benchmark: str, ruleset: str = DEFAULT_RULESET) -> list[Reference]:
    """Every RCP record's hyper-parameters (BERT/LAMB keys; records without them are skipped)."""
    raw: dict[str, Any] = json.loads((rcp_dir(ruleset) / f"rcps_{benchmark}.json").read_text())
    unit = RCP_UNITS.get(benchmark, 1.0)
    out = []
    for name, rec in raw.items():
        h = rec.get("Hyperparams") or {}
        if "opt_base_learning_rate" not in h or "opt_learning_rate_training_steps" not in h:
            continue
        betas = None
        if "opt_lamb_beta_1" in h and "opt_lamb_beta_2" in h:
            betas = (float(h["opt_lamb_beta_1"]), float(h["opt_lamb_beta_2"]))
        out.append(
            Reference(
                float(rec["BS"]),
                float(h["opt_base_learning_rate"]),
                int(h.get("num_warmup_steps", 0)),
                min(0, int(h.get("start_warmup_step", 0))),
                int(h["opt_learning_rate_training_steps"]),
                f"RCP {name} (batch {rec['BS']}, training_{ruleset}, unit {unit:g})",
                betas,
                h.get("opt_lamb_weight_decay_rate"),
            )
        )
    return sorted(out, key=lambda r: r.batch)


def config_reference(cfg: Any, rate: int = 1) -> Reference:
    """The config's own optimizer keys at its global batch (x ``rate``: in the curve's units)."""
    o, t = cfg.optim, cfg.train
    return Reference(
        float(t.global_batch * rate),
        float(o.lr),
        int(o.warmup_steps),
        int(o.start_warmup_step),
        int(o.total_steps or t.max_steps),
        f"the config (batch {t.global_batch}, LR {o.lr:g}, {o.total_steps or t.max_steps} steps)",
    )


def nearest(refs: list[Reference], batch: float) -> Reference:
    return min(refs, key=lambda r: (abs(math.log(batch / r.batch)), -r.batch))


def schedule_for(
    ref: Reference,
    curve: ConvergenceCurve,
    batch: int,
    rate: int,
    optimizer: str,
    every_samples: float | None,
) -> Schedule:
    """The schedule at ``batch`` (config units; one config sample is ``rate`` curve units).

    ``every_samples``: training samples (curve units) between evaluations at this batch (MLPerf's
    rule, scaleout.sim.step ``eval_interval``, or the config's interval); None: every step."""
    b = float(batch * rate)  # in the curve's (and the reference's) units
    scale = b / ref.batch
    lr = ref.lr * (math.sqrt(scale) if optimizer in SQRT_SCALED else scale)
    samples = curve.samples(b)
    steps = math.ceil(samples / b - 1e-9)
    # at least as often as the interval asks: a run stops at the first evaluation at the target
    every = max(1, math.floor((every_samples or b) / b + 1e-9))
    predicted = math.ceil(steps / every) * every
    horizon_samples = ref.horizon_steps * ref.batch * samples / curve.samples(ref.batch)
    total = max(math.ceil(horizon_samples / b - 1e-9), predicted, ref.warmup_steps + 1)
    return Schedule(
        batch,
        lr,
        ref.warmup_steps,
        ref.start_warmup_step,
        total,
        every,
        predicted,
        ref,
        ref.betas,
        ref.weight_decay,
    )
