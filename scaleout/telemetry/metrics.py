"""Training metrics you can look at: per-step loss, learning rate, throughput, step breakdown and
every evaluation, written by rank 0 to ``<train.output_dir>/metrics.jsonl`` always, and to CSV,
TensorBoard and Weights & Biases when ``train.metrics`` asks for them; :func:`plot_run` draws the
loss and eval curves (``metrics.png``) at the end of a run that logged at least
:data:`MIN_CURVE_POINTS` training records, or of any run when ``train.metrics`` lists ``png``; a
shorter run's numbers are in metrics.jsonl, and ``scaleout plot <run>`` draws it anyway. (The
picture costs rank 0 ~2 s of CPU, most of it importing matplotlib: at the end of a 3-step smoke run
that was a fifth of its wall time, for a curve of 3 points.)

``train.log_every = k`` writes one training record per k steps: the mean loss, the mean step time
and the samples/s over those k steps (so nothing is lost between records), plus the learning rate of
the last one. The other ranks do nothing here; on 2,048 ranks only rank 0 touches the file system.

Records (one JSON object per line, ``"type"`` says which):

- ``run``:   at every start or resume (world size, nodes, ranks per node, launcher, config, start
  step)
- ``train``: step, samples (cumulative), loss, lr, samples_per_s, tokens_per_s, step_s, breakdown_s,
  skipped; in a training run also ``stragglers`` and ``spread`` over the record's steps (every
  rank's phase times from the step's agreement: scaleout/train/skew.py)
- ``eval``:  step, samples, metric (its name), value, target
- ``end``:   status and the run's time-to-train

A resumed run appends: records of steps that were redone after the checkpoint appear twice, and the
readers here keep the latest of each step.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaleout.errors import ConfigError

if TYPE_CHECKING:
    from scaleout.train.observe import EvalRecord, StepRecord

JSONL = "metrics.jsonl"
CSV = "metrics.csv"
PNG = "metrics.png"
# Fewer training records than this draw no metrics.png unless train.metrics lists png (above).
MIN_CURVE_POINTS = 10
# Breakdown columns of the CSV: the trainer's phases (scaleout/train/trainer.py); "graph" =
# CUDA-graph replay.
PHASES = ("data", "forward", "backward", "exposed_comm", "optimizer", "graph")
# Optional sinks and the package each needs (pyproject extras tb / wandb).
PACKAGES = {
    "tensorboard": ("tensorboard", "tb"),
    "wandb": ("wandb", "wandb"),
    "png": ("matplotlib", "plot"),
}


def check_sinks(sinks: list[str]) -> None:
    """Fail before training (on every rank alike) when a requested sink's package is missing."""
    for name in sinks:
        pkg, extra = PACKAGES.get(name, (None, None))
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(
                f"train.metrics: {name} needs the {pkg} package (pip install 'scaleout[{extra}]')"
            )


class Metrics:
    """Rank 0's metrics writer. ``enabled=False`` (other ranks) makes every method a no-op."""

    def __init__(
        self,
        out_dir: str | Path,
        sinks: list[str] | tuple[str, ...] = (),
        log_every: int = 1,
        enabled: bool = True,
        config: dict[str, Any] | None = None,
    ):
        self.enabled = enabled
        self.sinks = tuple(sinks)
        self.log_every = max(1, log_every)
        self.out = Path(out_dir)
        self._acc: dict[str, Any] = self._empty()
        self._last_flush = 0.0
        self._csv: Any = None
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        check_sinks(list(sinks))
        self.out.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out / JSONL, "a")  # noqa: SIM115 -- closed in close()
        if "csv" in sinks:
            path = self.out / CSV
            new = not path.exists() or path.stat().st_size == 0
            self._csv_file = open(path, "a", newline="")  # noqa: SIM115 -- closed in close()
            self._csv = csv.writer(self._csv_file)
            if new:
                self._csv.writerow(
                    [
                        "kind",
                        "step",
                        "samples",
                        "loss",
                        "lr",
                        "samples_per_s",
                        "step_s",
                        *(f"{p}_s" for p in PHASES),
                        "metric",
                        "value",
                    ]
                )
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out / "tb"))
        if "wandb" in sinks:
            # WANDB_PROJECT / WANDB_MODE (e.g. offline) come from the environment, as usual
            import wandb

            self._wandb = wandb.init(dir=str(self.out), config=config or {})

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {
            "n": 0,
            "loss": 0.0,
            "seconds": 0.0,
            "samples": 0,
            "tokens": 0,
            "skipped": 0,
            "breakdown": {},
            "sampled": 0,
        }

    def _write(self, record: dict[str, Any], flush: bool = False) -> None:
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        now = time.monotonic()
        # tail -f works; a shared file system is not hit per step
        if flush or now - self._last_flush > 5.0:
            self._jsonl.flush()
            if self._csv is not None:
                self._csv_file.flush()
            self._last_flush = now

    def start(self, **info: Any) -> None:
        if self.enabled:
            self._write({"type": "run", "time": time.time(), **info}, flush=True)

    def step(self, record: StepRecord, extra: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Account one finished step; writes every ``log_every`` steps, and when ``record.flush``
        (an eval step, the last step, a stop) so that nothing accumulated is lost. ``extra``:
        more fields of the record, asked only when one is written. Returns whether it was."""
        if not self.enabled:
            return False
        a, step, samples, lr = self._acc, record.step, record.samples, record.lr
        a["n"] += 1
        a["loss"] += record.loss if record.loss is not None else float("nan")
        a["seconds"] += record.seconds
        a["samples"] += record.step_samples
        a["tokens"] += record.step_tokens
        a["skipped"] += int(record.skipped)
        if record.breakdown_s:  # only the steps the timers sampled (train.timing_every) have one
            a["sampled"] += 1
            for k, v in record.breakdown_s.items():
                a["breakdown"][k] = a["breakdown"].get(k, 0.0) + v
        if step % self.log_every and not record.flush:
            return False
        k, secs = a["n"], max(a["seconds"], 1e-12)
        rec = {
            "type": "train",
            "step": step,
            "samples": samples,
            "loss": a["loss"] / k,
            "lr": lr,
            "samples_per_s": a["samples"] / secs,
            "tokens_per_s": a["tokens"] / secs,
            "step_s": a["seconds"] / k,
            "breakdown_s": {
                p: v / max(a["sampled"], 1) for p, v in a["breakdown"].items()
            },  # {}: none sampled
            "skipped": a["skipped"],
            "time": time.time(),
            **(extra() if extra is not None else {}),
        }
        self._acc = self._empty()
        self._write(rec)
        if self._csv is not None:
            self._csv.writerow(
                [
                    "train",
                    step,
                    samples,
                    rec["loss"],
                    lr,
                    rec["samples_per_s"],
                    rec["step_s"],
                    *(rec["breakdown_s"].get(p, "") for p in PHASES),
                    "",
                    "",
                ]
            )
        scalars = {
            "train/loss": rec["loss"],
            "train/lr": lr,
            "train/samples_per_s": rec["samples_per_s"],
            "train/step_s": rec["step_s"],
            **{f"time/{p}_s": v for p, v in rec["breakdown_s"].items()},
        }
        self._scalars(scalars, step)
        return True

    def eval(self, record: EvalRecord) -> None:
        if not self.enabled:
            return
        step, metric, value = record.step, record.metric, record.value
        self._write(
            {
                "type": "eval",
                "step": step,
                "samples": record.samples,
                "metric": metric,
                "value": value,
                "target": record.target,
                "time": time.time(),
            },
            flush=True,
        )
        if self._csv is not None:
            self._csv.writerow(
                ["eval", step, record.samples, "", "", "", "", *([""] * len(PHASES)), metric, value]
            )
        self._scalars({f"eval/{metric}": value}, step)

    def _scalars(self, values: dict[str, float], step: int) -> None:
        if self._tb is not None:
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self, status: str | None = None, **info: Any) -> Path | None:
        """End record, close every sink and draw ``metrics.png`` (None without matplotlib)."""
        if not self.enabled:
            return None
        if status is not None:
            self._write({"type": "end", "status": status, "time": time.time(), **info}, flush=True)
        self._jsonl.close()
        if self._csv is not None:
            self._csv_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if "png" not in self.sinks and len(read_metrics(self.out)["train"]) < MIN_CURVE_POINTS:
            return None  # a few steps: the numbers are in metrics.jsonl (`scaleout plot` draws)
        return plot_run(self.out, quiet=True)


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    """``{"train": [...], "eval": [...], "runs": [...]}`` from a run's metrics.jsonl, sorted by
    step, the latest record of each step kept (a resumed run redoes the steps after its
    checkpoint)."""
    path = Path(run_dir) / JSONL
    if not path.is_file():
        raise ConfigError(
            f"{path}: no metrics file (expected a run directory written by `scaleout train`)"
        )
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        kind = rec.get("type")
        if kind == "train":
            train[int(rec["step"])] = rec
        elif kind == "eval":
            evals[int(rec["step"])] = rec
        elif kind == "run":
            runs.append(rec)
    return {
        "train": [train[s] for s in sorted(train)],
        "eval": [evals[s] for s in sorted(evals)],
        "runs": runs,
    }


def plot_run(
    run_dir: str | Path, out: str | Path | None = None, quiet: bool = False
) -> Path | None:
    """Loss (and learning rate) and eval curves of a run to a PNG; None when matplotlib is not
    installed."""
    data = read_metrics(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not quiet:
            print("(no PNG: matplotlib is not installed; pip install 'scaleout[plot]')", flush=True)
        return None
    train, evals = data["train"], data["eval"]
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(11, 4.2))
    if train:
        steps = [r["step"] for r in train]
        ax_loss.plot(steps, [r["loss"] for r in train], color="C0", lw=1.2, label="training loss")
        ax_loss.set_ylabel("loss")
        ax_lr = ax_loss.twinx()
        ax_lr.plot(
            steps, [r["lr"] for r in train], color="C1", lw=1, ls="--", label="learning rate"
        )
        ax_lr.set_ylabel("learning rate", color="C1")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lines = ax_loss.get_lines() + ax_lr.get_lines()
        ax_loss.legend(lines, [ln.get_label() for ln in lines], loc="upper right")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("training loss")
    ax_loss.grid(True, alpha=0.3)
    if evals:
        name = evals[-1]["metric"]
        ax_eval.plot(
            [r["step"] for r in evals],
            [r["value"] for r in evals],
            marker="o",
            color="C2",
            label=name,
        )
        target = evals[-1].get("target")
        if target is not None:
            ax_eval.axhline(target, color="C3", ls=":", label=f"target {target}")
        ax_eval.set_ylabel(name)
        ax_eval.legend(loc="lower right")
    ax_eval.set_xlabel("step")
    ax_eval.set_title("evaluation")
    ax_eval.grid(True, alpha=0.3)
    run = data["runs"][-1] if data["runs"] else {}
    if run:
        fig.suptitle(
            f"{run.get('config', '')}: {run.get('world_size', '?')} ranks "
            f"({run.get('nodes', '?')} nodes x {run.get('ranks_per_node', '?')}, "
            f"{run.get('launcher', '?')})"
        )
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / PNG
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
