"""MLPerf Training logging (``:::MLLOG`` lines via the official ``mlperf-logging`` package), rank 0
only.

    ml = MLPerfLogger("runs/x/mlperf.log", rank=world.rank)
    ml.init_start(); ml.submission("bert", org="scaleout", platform="2x2 cpu")
    ml.hyperparameters(scaleout.train.hparams.hyperparameters(cfg, world.world_size, config_file))
    ml.init_stop(); ml.run_start()
    ml.block_start(first_epoch_num=0, epoch_count=1, samples=0) ... ml.eval_accuracy(0.41,
    samples=...)
    ml.block_stop(...); ml.train_samples(n); ml.eval_samples(m); ml.run_stop("success")

We build our own ``mllog.MLLogger`` around a private ``logging.Logger`` instead of ``mllog.config``:
``config(filename=...)`` adds a file handler to one process-global logger, so two runs in one
process (tests, a sweep) would write into each other's files.

Attempts: the file is opened for appending, so a requeued (or manually resubmitted) run adds one
segment per attempt, each from ``cache_clear``/``init_start`` to ``run_stop``, and never erases the
log of an earlier attempt. The compliance checker takes exactly one run per file (``run_start``
EXACTLY_ONE), as NVIDIA's submission scripts write one result file per run; :func:`split_attempts`
cuts the file into those runs and :func:`check_compliance` checks one of them (the last by default).
Each attempt times only itself: an MLPerf time-to-train must come from one uninterrupted attempt.

Rulesets: the checker's newest ruleset (6.1.0) no longer lists BERT or ResNet as benchmarks; the
newest ones that do are 5.0.0 for BERT and 4.0.0 for ResNet (``RULESET``). We still log the keys
6.1.0 made mandatory (precision, parallelism, micro batch, config file) so the log is complete under
either.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from scaleout.diskfull import StrictFileHandler
from scaleout.errors import UserError

if TYPE_CHECKING:
    from scaleout.world import World

# Newest compliance-checker rulesets that still contain each benchmark (mlperf-logging 4.1.x).
RULESET = {"bert": "5.0.0", "resnet": "4.0.0", "llama31_8b": "6.1.0"}
# The closed-division quality targets those rulesets check (eval_accuracy ATLEAST_ONE_CHECK;
# llama31_8b's is a log-perplexity, lower is better).
TARGET = {"bert": 0.720, "resnet": 0.7590, "llama31_8b": 3.3}


# MLPerf's run_stop statuses: reached the target, or anything else.
RunStopStatus = Literal["success", "aborted"]

# One private logger name per MLPerfLogger. Not id(self): a dropped logger's address is reused,
# and logging.getLogger would hand the next one the old logger with its file handler still on it
# (every line written twice, into two files).
_LOGGER_SERIAL = itertools.count()


class MLPerfLogger:
    """Writes MLPerf log lines on rank 0; every method is a no-op on other ranks."""

    def __init__(self, path: str | os.PathLike[str] | None, rank: int = 0, stdout: bool = False):
        self.enabled = rank == 0 and (path is not None or stdout)
        self.path = Path(path) if path is not None else None
        self._handlers: list[logging.Handler] = []
        if not self.enabled:
            return
        from mlperf_logging import mllog
        from mlperf_logging.mllog.mllog import MLLogger

        self.constants = mllog.constants
        logger = logging.getLogger(
            f"scaleout.telemetry.mlperf.{os.getpid()}.{next(_LOGGER_SERIAL)}"
        )
        logger.propagate = False
        logger.setLevel(logging.INFO)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handlers.append(StrictFileHandler(self.path, mode="a"))  # a full disk raises
        # `:::MLLOG {...}` on rank 0's stdout too, as NVIDIA's run_and_time.sh prints them
        if stdout:
            self._handlers.append(logging.StreamHandler(sys.stdout))
        for h in self._handlers:
            logger.addHandler(h)
        # stack offset 2: report the trainer's call site, not this wrapper.
        self._ml = MLLogger(logger=logger, default_stack_offset=2)
        self._logger = logger

    # -- primitives
    # ---------------------------------------------------------------------------------
    def event(self, key: str, value: Any = None, metadata: dict[str, Any] | None = None) -> None:
        if self.enabled:
            self._ml.event(key=key, value=value, metadata=metadata)

    def start(self, key: str, value: Any = None, metadata: dict[str, Any] | None = None) -> None:
        if self.enabled:
            self._ml.start(key=key, value=value, metadata=metadata)

    def end(self, key: str, value: Any = None, metadata: dict[str, Any] | None = None) -> None:
        if self.enabled:
            self._ml.end(key=key, value=value, metadata=metadata)

    def close(self) -> None:
        """Flush and close the file; the private logger leaves logging's registry (a process that
        runs many trainings, a sweep or a test pool, keeps no handler or logger per run)."""
        for h in self._handlers:
            h.flush()
            h.close()
            if self.enabled:
                self._logger.removeHandler(h)
        self._handlers.clear()
        if self.enabled:
            logging.Logger.manager.loggerDict.pop(self._logger.name, None)
            self.enabled = False  # later events are no-ops, as on other ranks

    # -- the events a training run logs, in order
    # -----------------------------------------------------
    def cache_clear(self) -> None:
        self.event("cache_clear", True)

    def init_start(self) -> None:
        self.start("init_start")

    def submission(
        self,
        benchmark: str,
        org: str = "scaleout",
        division: str = "closed",
        status: str = "onprem",
        platform: str = "cpu",
    ) -> None:
        if division not in ("closed", "open"):
            raise UserError(f"MLPerf division '{division}' must be 'closed' or 'open'")
        self.event("submission_benchmark", benchmark)
        self.event("submission_org", org)
        self.event("submission_division", division)
        self.event("submission_status", status)
        self.event("submission_platform", platform)

    def hyperparameters(self, params: dict[str, Any]) -> None:
        for key, value in params.items():
            self.event(key, value)

    def init_stop(self) -> None:
        self.end("init_stop")

    def run_start(self) -> None:
        self.start("run_start")

    def block_start(self, first_epoch_num: int, epoch_count: int, samples: int) -> None:
        self.start(
            "block_start",
            metadata={
                "first_epoch_num": first_epoch_num,
                "epoch_count": epoch_count,
                "samples_count": samples,
            },
        )

    def block_stop(self, first_epoch_num: int, samples: int) -> None:
        self.end(
            "block_stop", metadata={"first_epoch_num": first_epoch_num, "samples_count": samples}
        )

    def epoch_start(self, epoch: int, samples: int) -> None:
        self.start("epoch_start", metadata={"epoch_num": epoch, "samples_count": samples})

    def epoch_stop(self, epoch: int, samples: int) -> None:
        self.end("epoch_stop", metadata={"epoch_num": epoch, "samples_count": samples})

    def eval_start(self, epoch_num: int, samples: int) -> None:
        self.start("eval_start", metadata={"epoch_num": epoch_num, "samples_count": samples})

    def eval_stop(self, epoch_num: int, samples: int) -> None:
        self.end("eval_stop", metadata={"epoch_num": epoch_num, "samples_count": samples})

    def eval_accuracy(self, value: float, epoch_num: int, samples: int) -> None:
        """BERT reports epoch_num = training samples seen (NVIDIA's submissions do the same)."""
        self.event(
            "eval_accuracy",
            float(value),
            metadata={"epoch_num": epoch_num, "samples_count": samples},
        )

    def train_samples(self, n: int) -> None:
        self.event("train_samples", int(n))

    def eval_samples(self, n: int) -> None:
        self.event("eval_samples", int(n))

    def run_stop(self, status: RunStopStatus, samples: int | None = None) -> None:
        if status not in get_args(RunStopStatus):
            raise UserError(f"MLPerf run_stop status '{status}' must be 'success' or 'aborted'")
        meta: dict[str, Any] = {"status": status}
        if samples is not None:
            meta["samples_count"] = samples
        self.end("run_stop", metadata=meta)


def default_platform(world: World) -> str:
    """``submission_platform`` when ``mlperf.platform`` is unset: nodes x ranks per node and the
    device, as the World reports them (e.g. ``2x2 cpu``, ``256x8 NVIDIA A100-SXM4-80GB``)."""
    import torch

    dev = torch.device(getattr(world, "device", "cpu"))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return f"{world.num_nodes}x{world.local_size} {name}"


def split_attempts(text: str) -> list[str]:
    """The ``:::MLLOG`` lines of an appended log, one string per attempt. An attempt starts at a
    ``cache_clear`` (the first event the trainer logs), or at an ``init_start`` once the current
    attempt has logged anything but ``cache_clear``. Works on a captured stdout too
    (``mlperf.stdout``): other lines are left out, and a launcher's prefix before ``:::MLLOG``
    (``[rank 0] ``) is cut."""
    attempts: list[list[str]] = []
    keys: set[str] = set()
    for raw in text.splitlines():
        at = raw.find(":::MLLOG")
        if at < 0:
            continue
        line = raw[at:]
        m = re.search(r'"key":\s*"([^"]+)"', line)
        key = m.group(1) if m else ""
        if not attempts or key == "cache_clear" or (key == "init_start" and keys - {"cache_clear"}):
            attempts.append([])
            keys = set()
        attempts[-1].append(line)
        keys.add(key)
    return ["\n".join(a) + "\n" for a in attempts]


def check_compliance(
    path: str | os.PathLike[str],
    benchmark: str,
    ruleset: str | None = None,
    quality_target: float | None = None,
    timeout: float = 120.0,
    attempt: int = -1,
) -> tuple[bool, str]:
    """Run the real ``mlperf_logging.compliance_checker`` on one attempt of ``path`` (the checker
    takes one run per file; ``attempt`` indexes :func:`split_attempts`, the last by default);
    returns (passed, output).

    ``quality_target`` runs the unmodified rule files of the ruleset except that the closed-division
    quality threshold (``eval_accuracy`` ATLEAST_ONE_CHECK, 0.720 for BERT) becomes the given value:
    a CPU-sized run cannot reach the full-size target, but every other rule still applies.
    """
    if benchmark not in RULESET:
        raise UserError(
            f"no MLPerf ruleset known for benchmark '{benchmark}' (expected one of "
            f"{sorted(RULESET)})"
        )
    ruleset = ruleset or RULESET[benchmark]
    attempts = split_attempts(Path(path).read_text())
    if not -len(attempts) <= attempt < len(attempts):
        raise UserError(
            f"{path}: attempt {attempt} does not exist (the log holds {len(attempts)} attempt(s))"
        )
    args = [
        sys.executable,
        "-m",
        "mlperf_logging.compliance_checker",
        "--usage",
        "training",
        "--ruleset",
        ruleset,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        if quality_target is not None:
            args += ["--config", str(_relaxed_rules(Path(tmp), ruleset, benchmark, quality_target))]
        one = Path(tmp) / f"attempt-{attempt % len(attempts)}.log"
        one.write_text(attempts[attempt])
        args += ["--log_output", os.path.join(tmp, "checker.log"), str(one)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    out = (
        f"attempt {attempt % len(attempts) + 1} of {len(attempts)} in {path}\n"
        + proc.stdout
        + proc.stderr
    )
    return proc.returncode == 0 and "SUCCESS" in out, out


def _relaxed_rules(tmp: Path, ruleset: str, benchmark: str, target: float) -> Path:
    """Copy every rule directory; rewrite only the eval_accuracy threshold of
    closed_<benchmark>.yaml (and of open_<benchmark>.yaml where it has one)."""
    import mlperf_logging.compliance_checker as cc

    src = Path(cc.__file__).parent
    for d in src.glob("training_*"):
        shutil.copytree(d, tmp / d.name)
    for f in tmp.glob("training_*/*.yaml"):
        text = f.read_text().replace(
            "enqueue_config('training_", f"enqueue_config('{tmp}/training_"
        )
        f.write_text(text)
    # the threshold's direction is the benchmark's (bert: >= 0.720; llama31_8b: <= 3.3, and its
    # open division's placeholder < 1.0): closed must hold exactly one, open may hold one
    for division, want in (("closed", (1,)), ("open", (0, 1))):
        rule = tmp / f"training_{ruleset}" / f"{division}_{benchmark}.yaml"
        if not rule.exists() and division == "open":
            continue
        text, n = re.subn(
            r"(ATLEAST_ONE_CHECK:.*?v\['value'\]\s*(?:>=|<=|<)\s*)[0-9.]+",
            rf"\g<1>{target!r}",
            rule.read_text(),
        )
        if n not in want:
            raise UserError(f"{rule}: expected one eval_accuracy threshold to replace, found {n}")
        rule.write_text(text)
    return tmp / f"training_{ruleset}" / "common.yaml"


# -- RCP check over seeds ----------------------------------------------------------------------


@dataclass
class RCPResult:
    """What :func:`check_rcp` found: the checker's verdict over one set of seed logs."""

    passed: bool
    message: str  # the checker's: "RCP found", "RCP Interpolation", "Missing RCP ...", ...
    benchmark: str
    ruleset: str
    global_batch: int
    epochs: list[float]  # epochs to converge per log (inf: did not converge), in log order
    required_runs: int  # the submission runs the rules ask for at this benchmark (resnet: 5)
    norm_factor: float  # the checker's score normalisation (1.0: converged no faster than the RCP)
    logs: list[str] = field(default_factory=list)

    def render(self) -> str:
        rows = "\n".join(
            f"  {e if e != float('inf') else 'did not converge'}  {p}"
            for e, p in zip(self.epochs, self.logs, strict=True)
        )
        short = len(self.logs) < self.required_runs
        note = (
            f"\nnote: {len(self.logs)} logs; an RCP claim needs {self.required_runs} runs"
            if short
            else ""
        )
        return (
            f"RCP check ({self.benchmark}, ruleset {self.ruleset}, global batch "
            f"{self.global_batch}): {'PASSED' if self.passed else 'FAILED'}: {self.message}\n"
            f"epochs to converge per log:\n{rows}\n"
            f"score normalisation factor: {self.norm_factor:.4f}{note}"
        )


def find_logs(paths: list[str | os.PathLike[str]]) -> list[Path]:
    """MLPerf logs named on a command line: files as given; a directory gives every
    ``mlperf.log`` under it (one run directory per seed) and its ``result_*.txt`` files."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and (f.name == "mlperf.log" or re.fullmatch(r"result_.*\.txt", f.name))
            )
            if not found:
                raise UserError(f"{p}: no mlperf.log or result_*.txt under this directory")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UserError(f"{p}: no such MLPerf log file or directory")
    return out


def check_rcp(
    logs: list[str | os.PathLike[str]],
    benchmark: str | None = None,
    ruleset: str | None = None,
    rcp_file: str | os.PathLike[str] | None = None,
    rcp_pass: str = "pruned_rcps",
) -> RCPResult:
    """Run ``mlperf_logging.rcp_checker`` (the real one) over the seed logs ``logs`` (files or
    directories, :func:`find_logs`): the last attempt of each (:func:`split_attempts`) becomes one
    ``result_<i>.txt``, as a submission's results directory holds them. ``benchmark`` defaults to
    the logs' ``submission_benchmark``; ``ruleset`` to :data:`RULESET`'s; ``rcp_file`` replaces the
    package's RCP table (the checker's ``--custom_rcps``: e.g. RCPs measured for a CPU stand-in)."""
    from mlperf_logging.rcp_checker import rcp_checker  # deferred: scipy and numpy on demand

    files = find_logs(logs)
    if len(files) < 3:
        raise UserError(
            f"the RCP check needs at least 3 seed logs (olympic scoring drops the fastest and the "
            f"slowest), got {len(files)}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for i, f in enumerate(files):
            attempts = split_attempts(f.read_text(encoding="latin-1"))
            if not attempts:
                raise UserError(f"{f}: no :::MLLOG lines")
            results.append(Path(tmp) / f"result_{i}.txt")
            results[-1].write_text(attempts[-1])
        found = _logged_benchmark(results[0])
        benchmark = benchmark or found
        if benchmark not in RULESET:
            raise UserError(
                f"no MLPerf ruleset known for benchmark {benchmark!r} (expected one of "
                f"{sorted(RULESET)})"
            )
        ruleset = ruleset or RULESET[benchmark]
        epochs = [rcp_checker.read_submission_file(str(r), ruleset, False)[1] for r in results]
        bs = rcp_checker.get_submission_epochs([str(r) for r in results], ruleset, False)[0]
        custom = open(rcp_file) if rcp_file is not None else None  # noqa: SIM115
        try:
            passed, message, norm = rcp_checker.check_directory(
                tmp, "training", ruleset, False, False, rcp_file=custom, rcp_pass=rcp_pass
            )
        finally:
            if custom is not None:
                custom.close()
    return RCPResult(
        passed=bool(passed),
        message=message,
        benchmark=benchmark,
        ruleset=ruleset,
        global_batch=int(bs),
        epochs=[float("inf") if e >= 1e9 else float(e) for e in epochs],
        required_runs=rcp_checker.submission_runs["training"].get(benchmark, 0),
        norm_factor=float(norm),
        logs=[str(f) for f in files],
    )


def _logged_benchmark(path: Path) -> str | None:
    m = re.search(r'"key":\s*"submission_benchmark",\s*"value":\s*"([^"]+)"', path.read_text())
    return m.group(1) if m else None


def mlperf_numerics(
    precision: str, device: Any, compression: str, convolutions: bool
) -> dict[str, str]:
    """MLPerf's lowest_numerical_precision_in_{linear,attn,comm} for what runs (mlperf_logging
    names).

    fp32 on CUDA is TF32 where torch lets the matmul/convolution use it (``allow_tf32`` flags and
    ``torch.get_float32_matmul_precision()``); gradients are fp32 (master weights) unless the
    reducer compresses them on the wire. ``convolutions``: the model's matmuls include
    convolutions (``Family.convolutions``: cuDNN's TF32 flag applies)."""
    import torch

    dev = torch.device(device)
    names = {"fp32": "fp32", "bf16": "bfloat16", "fp16": "fp16"}
    linear = attn = names[precision]
    if precision == "fp32" and dev.type == "cuda":
        tf32_matmul = (
            torch.backends.cuda.matmul.allow_tf32
            or torch.get_float32_matmul_precision() != "highest"
        )
        tf32_conv = torch.backends.cudnn.allow_tf32 and convolutions
        linear = "tf32" if tf32_matmul or tf32_conv else "fp32"
        attn = "tf32" if tf32_matmul else "fp32"
    comm = {"none": "fp32", "bf16": "bfloat16", "fp16": "fp16"}[compression]
    return {
        "lowest_numerical_precision_in_linear": linear,
        "lowest_numerical_precision_in_attn": attn,
        "lowest_numerical_precision_in_comm": comm,
    }
