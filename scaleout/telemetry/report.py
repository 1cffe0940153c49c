"""End-of-run report: time-to-train, throughput, MFU, HPC-AI500 Valid FLOPS, step-time breakdown.

FLOP conventions (one multiply-add = 2 FLOPs; training = forward + backward = 3 x forward):

* BERT: counted per step from what ran (real tokens, each sequence's own attention span, the MLM
  head where it ran) by :mod:`scaleout.families.bert.flops`, checked against ``FlopCounterMode``.
* ResNet: forward multiply-adds from the config by :mod:`scaleout.families.resnet.flops` (4.09 G for
  ResNet-50 v1.5 at 224x224), checked against the real model's; training = 3 x 2 x forward.

Each family owns its formula (scaleout/families/<arch>/flops.py); the trainer counts each
micro-batch with it, and this report divides what was counted.

MFU = achieved model FLOP/s / (devices x peak FLOP/s per device) (PaLM appendix B). The peak comes
from :mod:`scaleout.telemetry.devices`: a GPU part identified by name, SM count and memory
(data-sheet numbers
for the run's precision), a CPU peak measured on the machine, or None -- then MFU is reported as
unknown.

HPC-AI500 Valid FLOPS (Jiang et al., "HPC AI500 V2.0", arXiv 2007.00279, sec. 4): VFLOPS = FLOPS x
(achieved quality / target quality)^n, with n = 5 for image classification. The paper gives no n for
language models; we use n = 5 for BERT's masked-LM accuracy too, because it is the same kind of
metric (a top-1 classification accuracy over the vocabulary, on a 0..1 scale), so a shortfall should
cost the same. Each family declares its n (``Family.quality_exponent``); pass ``quality_exponent``
to change it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from scaleout.errors import UserError
from scaleout.families import FAMILIES
from scaleout.output import format_table


def valid_flops(flops: float, achieved: float, target: float, n: float) -> float:
    """HPC-AI500 Valid FLOPS = FLOPS * (achieved / target)^n."""
    if target <= 0:
        raise UserError(f"valid_flops needs a positive quality target, got {target}")
    return flops * (achieved / target) ** n


@dataclass
class RunReport:
    """What a run measured; ``render()`` makes the table, ``to_dict()`` the JSON."""

    arch: str
    time_to_train_s: float  # MLPerf run_start -> run_stop
    steps: int
    samples: int
    flops_per_sample: float
    devices: int
    real_tokens: int = 0  # BERT: non-padding tokens processed (0 for images)
    achieved: float | None = None  # final eval quality
    target: float | None = None
    quality_exponent: float | None = None
    device_name: str = "unknown"
    peak_flops_per_device: float | None = None  # None: the device's peak is unknown, so is MFU
    peak_source: str = ""
    breakdown_s: dict[str, float] = field(default_factory=dict)  # mean seconds per step, by phase
    # HPC-AI500 mode (config hpcai500): Valid FLOPS against its own target (0.763 for ImageNet
    # top-1) instead of ``target`` (train.target, MLPerf's 0.759)
    hpcai500_target: float | None = None

    def __post_init__(self) -> None:
        if self.time_to_train_s <= 0:
            raise UserError(f"time_to_train_s must be positive, got {self.time_to_train_s}")
        if self.quality_exponent is None:
            fam = FAMILIES.get(self.arch) if self.arch in FAMILIES else None
            self.quality_exponent = fam.quality_exponent if fam is not None else 5.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.time_to_train_s

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.time_to_train_s

    @property
    def flops_per_s(self) -> float:
        return self.samples * self.flops_per_sample / self.time_to_train_s

    @property
    def mfu(self) -> float | None:
        if not self.peak_flops_per_device:
            return None
        return self.flops_per_s / (self.devices * self.peak_flops_per_device)

    @property
    def quality_target(self) -> float | None:
        """The target Valid FLOPS is computed against: HPC-AI500's in that mode, else
        train.target."""
        return self.hpcai500_target if self.hpcai500_target is not None else self.target

    @property
    def quality_ratio(self) -> float | None:
        """achieved / quality target, raw: uncapped, so overshooting the target earns a bonus in
        Valid FLOPS, as the published formula does."""
        if self.achieved is None or self.quality_target is None:
            return None
        fam = FAMILIES.get(self.arch) if self.arch in FAMILIES else None
        if fam is not None:  # in the metric's direction (log-perplexity: target / achieved)
            return fam.quality_ratio(self.achieved, self.quality_target)
        return self.achieved / self.quality_target

    @property
    def valid_flops_per_s(self) -> float | None:
        if self.achieved is None or self.quality_target is None:
            return None
        better, worse = self.achieved, self.quality_target
        fam = FAMILIES.get(self.arch) if self.arch in FAMILIES else None
        if fam is not None and fam.metric_goal == "min":  # lower is better: target / achieved
            better, worse = worse, better
        return valid_flops(self.flops_per_s, better, worse, float(self.quality_exponent))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            samples_per_s=self.samples_per_s,
            tokens_per_s=self.tokens_per_s,
            flops_per_s=self.flops_per_s,
            mfu=self.mfu,
            quality_ratio=self.quality_ratio,
            valid_flops_per_s=self.valid_flops_per_s,
        )
        return d

    def render(self) -> str:
        rows: list[list[Any]] = [
            ["time to train (run_start -> run_stop)", f"{self.time_to_train_s:.2f} s"],
            ["steps / samples", f"{self.steps} / {self.samples}"],
            ["samples/s", f"{self.samples_per_s:.1f}"],
        ]
        if self.real_tokens:
            rows.append(["real tokens/s", f"{self.tokens_per_s:.0f}"])
        rows.append(["model TFLOP/s (all devices)", f"{self.flops_per_s / 1e12:.4f}"])
        if self.mfu is None:
            rows.append(
                [
                    f"MFU ({self.devices} x {self.device_name})",
                    f"unknown ({self.peak_source or 'no peak'})",
                ]
            )
        else:
            rows.append(
                [
                    f"MFU ({self.devices} x {self.device_name}, "
                    f"{self.peak_flops_per_device / 1e12:.4g} TFLOP/s "
                    f"peak: {self.peak_source})",
                    f"{self.mfu:.2%}",
                ]
            )
        if self.achieved is not None and self.target is not None:
            rows.append(["quality achieved / target", f"{self.achieved:.4f} / {self.target:.4f}"])
        if self.quality_ratio is not None:
            mode = "HPC-AI500 target" if self.hpcai500_target is not None else "target"
            rows.append(
                [
                    f"quality ratio achieved / {mode} {self.quality_target:.4f} (raw, uncapped)",
                    f"{self.quality_ratio:.4f}",
                ]
            )
            rows.append(
                [
                    f"HPC-AI500 Valid TFLOP/s (n={self.quality_exponent:g}, x ratio^n)",
                    f"{self.valid_flops_per_s / 1e12:.4f}",
                ]
            )
        out = format_table(["metric", "value"], rows)
        if self.breakdown_s:
            total = sum(self.breakdown_s.values()) or 1.0
            from scaleout.telemetry.timers import PHASES  # deferred: timers imports torch

            names = [p for p in PHASES if p in self.breakdown_s] + sorted(
                set(self.breakdown_s) - set(PHASES)
            )
            brows = [
                [n, f"{self.breakdown_s[n] * 1e3:.2f}", f"{self.breakdown_s[n] / total:.1%}"]
                for n in names
            ]
            out += "\n\n" + format_table(["phase", "ms/step", "share"], brows)
        return out


# -- goodput
# -----------------------------------------------------------------------------------------
def young_daly_interval_s(save_stall_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum checkpoint interval sqrt(2 C M), in seconds of training
    between saves: C the time a save stalls training, M the job's mean time between failures
    (a node's MTBF / nodes). Daly (2006) adds higher-order terms that matter only when C is a
    sizeable fraction of M."""
    if save_stall_s < 0 or mtbf_s <= 0:
        raise UserError(
            f"young_daly_interval_s needs a save stall >= 0 and an MTBF > 0, got "
            f"{save_stall_s} s and {mtbf_s} s"
        )
    return math.sqrt(2.0 * save_stall_s * mtbf_s)


def expected_goodput(
    interval_s: float, save_stall_s: float, restart_s: float, mtbf_s: float
) -> float:
    """The fraction of wall time spent on steps that count, to first order: each save stalls
    ``save_stall_s`` per ``interval_s`` of training, and each failure (one per ``mtbf_s`` of wall
    time, Poisson) costs ``restart_s`` plus, on average, half an interval of lost work."""
    if interval_s <= 0 or mtbf_s <= 0 or save_stall_s < 0 or restart_s < 0:
        raise UserError(
            f"expected_goodput needs interval > 0, MTBF > 0, stall and restart >= 0, got "
            f"{interval_s}, {mtbf_s}, {save_stall_s}, {restart_s}"
        )
    period = interval_s + save_stall_s
    saving = interval_s / period
    failing = 1.0 - (restart_s + period / 2.0) / mtbf_s
    return max(0.0, saving * failing)


def goodput_section(
    *,
    useful_step_s: float,
    wall_s: float,
    startup_s: float = 0.0,
    save_stall_s: float = 0.0,
    evaluation_s: float = 0.0,
    restart_s: float = 0.0,
) -> dict[str, Any]:
    """report.json's ``goodput``: useful step time / wall time, and where the rest went.
    ``wall_s`` is this segment's (process start to the end of the run); ``restart_s`` (time lost
    to the failure or preemption before it: downtime and work redone) is added to it. ``other``
    is the remainder (logging, barriers, the final report), so the parts sum to ``wall_s``."""
    wall = max(wall_s, 0.0) + max(restart_s, 0.0)
    lost = {
        "restart_s": max(restart_s, 0.0),
        "startup_s": max(startup_s, 0.0),
        "save_stall_s": max(save_stall_s, 0.0),
        "evaluation_s": max(evaluation_s, 0.0),
    }
    lost["other_s"] = max(wall - useful_step_s - sum(lost.values()), 0.0)
    return {
        "goodput": useful_step_s / wall if wall > 0 else None,
        "wall_s": wall,
        "useful_step_s": useful_step_s,
        "lost": lost,
    }


def verdict(
    status: str,
    achieved: float | None,
    target: float | None,
    steps: int,
    time_to_train_s: float,
    out: str,
    goal: str = "max",
) -> str:
    """The run's last line: did it reach the target, where, how fast, and where its files are.
    ``goal``: the family's metric direction ("min": log-perplexity)."""
    files = f"report {out}/report.json, MLPerf log {out}/mlperf.log"
    reached, short = ("<=", ">") if goal == "min" else (">=", "<")
    if status == "success" and achieved is not None and target is not None:
        head = f"TARGET REACHED: {achieved:.4f} {reached} {target:g} after {steps} steps"
    elif target is None:
        head = f"{status.upper()}: {steps} steps, no target (train.target=null)"
    else:
        got = "no evaluation" if achieved is None else f"{achieved:.4f}"
        head = f"TARGET NOT REACHED ({status}): {got} {short} {target:g} after {steps} steps"
    return f"{head}, time to train {time_to_train_s:.2f} s; {files}"
