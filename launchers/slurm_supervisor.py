"""``scaleout slurm run``: the batch scripts' training step, restarted inside the allocation when
it dies.

The sbatch scripts (slurm/bert_256node.sh, resnet50_128node.sh) ``exec`` this on the batch host
instead of a bare ``srun``. It runs ``srun --kill-on-bad-exit=1 -w <nodes>`` on ``launch.nnodes``
healthy nodes of the allocation; the allocation's other nodes are spares. When the step dies:

1. **Which node.** In order of evidence: (a) the hang verdict the surviving ranks leave in
   ``$SCALEOUT_VERDICT_DIR`` (scaleout.train.faults.write_verdict: the ranks whose heartbeat
   stopped, by SLURM_NODEID, mapped here to the step's hosts) -- a stopped, hung or dead node;
   (b) else srun's first ``srun: error: <host>: task(s) N: <signal>`` line, before it terminates
   the step: a rank killed by a signal (OOM killer, SIGKILL, SIGBUS, a node going away). A rank
   that *exited* with a code (a Python error) names no node: a software crash is retried on the
   same nodes, and the crash-loop guard stops it. Nor does one that *aborted* (SIGABRT: NCCL's
   watchdog on a timeout, which fires first on a rank that waited, not on the culprit): without a
   verdict the step names nobody rather than a healthy node.
2. **Quarantine.** Named nodes go to ``runs/<name>/quarantine.json`` (scaleout.goodput.quarantine),
which
   every later start of the run reads: quarantined nodes of an allocation are never used. So do
   the nodes a replica vote named after any step, a finished one too (rank 0's
   ``rank0-replicas.json``: ranks whose weights differed from the majority's, source
   ``replica-vote``; scaleout.train.replicas).
3. **Continue.** With ``launch.nnodes`` healthy nodes left, a new step starts at once on them and
   the run resumes from its latest checkpoint (the trainer's own resume). Without, the job is
   requeued with the quarantined nodes excluded (``scontrol requeuehold``, ``scontrol update
   ExcNodeList``, ``scontrol release``: Slurm refuses ExcNodeList on a running job).
4. **Crash-loop guard.** Every attempt is recorded in run.json's ``attempts`` (job, nodes, exit,
   the checkpoint step it resumed from and reached, bad nodes). When the last K attempts all died
   without a checkpoint past the same step (K = ``launch.crash_loop``), the job stops with one
   line and is not requeued.

A SIGTERM to the job (scancel, requeue, time limit) or a preemption exit (75: rank 0 already
requeued) ends the supervisor after its step, without a new one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scaleout.checkpoint import Checkpointer
from scaleout.env.nodelist import expand_nodelist, parse_tasks_per_node
from scaleout.errors import UserError
from scaleout.goodput import quarantine
from scaleout.goodput.preempt import EXIT_PREEMPTED
from scaleout.launchers.container import srun_args as container_srun
from scaleout.launchers.slurm import job_info
from scaleout.launchers.slurm_fit import fit
from scaleout.train.faults import VERDICT_DIR
from scaleout.train.rerun import read_record, write_record

DEFAULT_CRASH_LOOP = 3
# srun's report of a task that ended badly: "srun: error: n2: task 3: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 1".
_SRUN_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (.+)$")
# srun ending the step itself: "srun: launch/slurm: _step_signal: Terminating StepId=224.0",
# "srun: Force Terminated StepId=224.0", "srun: Job step aborted: ...".
_SRUN_TERMINATING = re.compile(r"Terminat(ing|ed) StepId|Job step aborted", re.IGNORECASE)
_STEP_ID = re.compile(r"StepId=(\d+\.\d+)")
# A task that died of SIGABRT aborted itself: ProcessGroupNCCL's watchdog on a collective timeout
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=3 ends in std::terminate), a C++ assert. The first such line is
# the rank whose collective started earliest, a rank that was *waiting* for the culprit: it names no
# node (the verdict, written before NCCL's timeout by scaleout's hang watch, is the evidence).
_SELF_ABORT = "Aborted"
KILL_AFTER_S = 3.0  # after srun starts ending a failed step, what is left of it is killed
EXIT_BAD_INPUT = 2  # a UserError in the ranks (scaleout.cli.main): retrying cannot help


def log(msg: str) -> None:
    print(f"scaleout slurm run: {msg}", file=sys.stderr, flush=True)


@dataclass
class Allocation:
    job_id: str
    nodes: list[str]  # in the cluster's order (as SLURM_NODEID numbers a step's nodes)
    tasks_per_node: int
    restart: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
        if not job or not nodelist:
            raise UserError(
                "run: SLURM_JOB_ID / SLURM_JOB_NODELIST are not set: expected to run inside an "
                "sbatch script (slurm/bert_256node.sh)"
            )
        nodes = expand_nodelist(nodelist)
        tpn = parse_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "1"), len(nodes))
        return cls(job, nodes, max(tpn), int(env.get("SLURM_RESTART_COUNT", "0") or 0))


@dataclass
class TrainCommand:
    """The step's command and what the supervisor needs from its config."""

    argv: list[str]
    nnodes: int
    ckpt_dir: str | None
    output_dir: str  # the run directory: quarantine.json, attempts/
    crash_loop: int = DEFAULT_CRASH_LOOP
    srun_args: list[str] = field(default_factory=list)  # launch.container: before the command
    fit: Any = None  # (the allocation's nodes, tasks per node) -> slurm_fit.Shape

    @classmethod
    def parse(cls, argv: Sequence[str]) -> TrainCommand:
        from scaleout.config import load_config  # deferred: pydantic + the schema, ~0.3 s

        argv = list(argv)
        if argv[:1] == ["--"]:
            argv = argv[1:]
        if argv[:1] and argv[0].startswith("-"):
            raise UserError(
                f"run: unexpected option {argv[0]!r}: expected '-- scaleout train CONFIG "
                "[overrides]' (settings are config keys: launch.nnodes, launch.crash_loop)"
            )
        try:
            at = argv.index("train")
            config, overrides = argv[at + 1], argv[at + 2 :]
        except (ValueError, IndexError):
            raise UserError(
                f"run: expected the step's command '-- scaleout train CONFIG [overrides]', got "
                f"{' '.join(argv) or 'nothing'!r}"
            ) from None
        cfg = load_config(config, overrides)

        def fit_to(nodes: list[str], tasks_per_node: int) -> Any:
            return fit(config, overrides, cfg, load_config(config, []), nodes, tasks_per_node)

        return cls(
            argv,
            cfg.launch.nnodes,
            cfg.checkpoint.dir,
            cfg.train.output_dir,
            cfg.launch.crash_loop,
            container_srun(cfg.launch.container),
            fit_to,
        )

    def fitted(self, alloc: Allocation) -> TrainCommand:
        """This command on ``alloc``'s shape (launchers/slurm_fit.py); UserError if it cannot."""
        if self.fit is None:
            return self
        shape = self.fit(alloc.nodes, alloc.tasks_per_node)
        return replace(self, argv=[*self.argv, *shape.overrides], nnodes=shape.nnodes)


def choose_nodes(alloc: list[str], excluded: set[str], nnodes: int) -> list[str] | None:
    """The first ``nnodes`` nodes of the allocation not excluded (allocation order), or None."""
    healthy = [n for n in alloc if n not in excluded]
    return healthy[:nnodes] if len(healthy) >= nnodes else None


def read_verdicts(folder: Path, before: float | None = None) -> list[dict[str, Any]]:
    """The verdicts the ranks left, those written before ``before`` only: once srun ends the step
    it sends SIGCONT + SIGTERM to every task, a stopped rank wakes up to a broken collective and
    reports too -- blaming the ranks that already exited."""
    out = []
    for f in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            v = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if before is None or float(v.get("time", 0.0)) <= before:
            out.append(v)
    return out


def bad_nodes(
    verdicts: Sequence[Mapping[str, Any]], step_nodes: Sequence[str], srun_lines: Sequence[str]
) -> dict[str, tuple[str, str]]:
    """host -> (reason, source) of the nodes this failed step names (see the module docstring).

    A node that a verdict's writer runs on is alive whatever the heartbeats say (a starved
    heartbeat thread on an overloaded host): it is never named from a verdict. When the verdicts
    name no other node, the step's nodes from which no rank reported are: a live rank whose
    collective failed always writes one (the verdict is shared through the store, and rank 0
    waits for the readers before it exits and srun ends the step)."""
    if any("crashed" in v for v in verdicts):
        return {}  # a rank died of its own exception: a software error names no node
    found: dict[str, tuple[str, str]] = {}
    alive = {v.get("node") for v in verdicts}
    for v in verdicts:
        for i in v.get("stale_nodes", []):
            if isinstance(i, int) and 0 <= i < len(step_nodes) and i not in alive:
                ranks = list(v.get("stale_ranks", []))
                found.setdefault(
                    step_nodes[i],
                    (f"no heartbeat from ranks {ranks} (stopped, hung or dead)", "heartbeat"),
                )
    if found:
        return found
    silent = [h for i, h in enumerate(step_nodes) if i not in alive]
    if verdicts and None not in alive and 0 < len(silent) < len(step_nodes):
        return {
            h: ("no rank reported when the step's collectives failed", "heartbeat") for h in silent
        }
    for line in srun_lines:
        if _SRUN_TERMINATING.search(line):
            break  # what srun kills after this is its own doing (--kill-on-bad-exit)
        m = _SRUN_TASK.match(line.strip())
        if m and not m.group(3).startswith(("Exited with exit code", _SELF_ABORT)):
            return {m.group(1): (f"task {m.group(2)}: {m.group(3)}", "srun")}
    return {}


def replica_nodes(
    verdicts: Sequence[Mapping[str, Any]], step_nodes: Sequence[str]
) -> dict[str, str]:
    """host -> reason for the nodes a replica vote named (scaleout.train.replicas: their ranks'
    weights differed from the majority's), whatever the step's exit."""
    found: dict[str, str] = {}
    for v in verdicts:
        for i in v.get("odd_nodes", []):
            if isinstance(i, int) and 0 <= i < len(step_nodes):
                found.setdefault(step_nodes[i], str(v.get("text", "replicas differ")))
    return found


def bad_input(srun_lines: Sequence[str]) -> bool:
    """A rank exited with scaleout's bad-input code before srun ended the step."""
    for line in srun_lines:
        if _SRUN_TERMINATING.search(line):
            return False
        m = _SRUN_TASK.match(line.strip())
        if m and m.group(3) == f"Exited with exit code {EXIT_BAD_INPUT}":
            return True
    return False


def crash_loop(attempts: Sequence[Mapping[str, Any]], k: int) -> str | None:
    """One line when the last ``k`` attempts all died without a checkpoint past the same step."""
    tail = list(attempts)[-k:]
    if len(tail) < k or any(a.get("outcome") != "died" for a in tail):
        return None
    if len({a.get("progress") for a in tail}) != 1:
        return None
    died, ckpt = max(int(a.get("died_at_step") or 0) for a in tail), tail[-1].get("progress")
    where = (
        f"at step {died} (none got past the checkpoint at step {ckpt})"
        if died != ckpt
        else f"after step {ckpt} (its checkpoint) before the next checkpoint"
    )
    return f"{k} attempts died {where}: stopping, not requeueing"


def _train_records(output_dir: str, since: float) -> Iterator[dict]:
    """Rank 0's training records in metrics.jsonl logged at or after ``since`` (best effort: the
    file is flushed every few seconds, a killed rank loses the rest; unreadable: none)."""
    try:
        with open(Path(output_dir) / "metrics.jsonl") as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("type") == "train" and float(rec.get("time", 0)) >= since:
            yield rec


def last_logged_step(output_dir: str, since: float) -> int | None:
    """The last training step rank 0 logged to metrics.jsonl after ``since``."""
    step = None
    for rec in _train_records(output_dir, since):
        step = int(rec["step"])
    return step


def first_step_after(output_dir: str, since: float) -> float | None:
    """Wall time of the first training step logged after ``since`` (the recovery's end)."""
    for rec in _train_records(output_dir, since):
        return float(rec["time"])
    return None


@dataclass
class Supervisor:
    alloc: Allocation
    cmd: TrainCommand
    run_dir: Path
    crash_loop_k: int = DEFAULT_CRASH_LOOP
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    terminating: bool = False
    first_exit: float | None = None
    _proc: subprocess.Popen | None = None

    # -- state on disk --------------------------------------------------------------------------
    @property
    def qfile(self) -> Path:
        return quarantine.path_for(self.run_dir)

    def checkpoint_step(self) -> int:
        if not self.cmd.ckpt_dir:
            return 0
        steps = Checkpointer(self.cmd.ckpt_dir).list()
        return steps[-1][0] if steps else 0

    def record_attempt(self, attempt: dict[str, Any]) -> list[dict[str, Any]]:
        """Append to run.json's ``attempts`` (only between steps: no rank writes it then)."""
        if not self.cmd.ckpt_dir:
            return [attempt]
        record = read_record(self.cmd.ckpt_dir)
        record["attempts"] = [*record.get("attempts", []), attempt]
        write_record(self.cmd.ckpt_dir, record)
        return record["attempts"]

    # -- Slurm ----------------------------------------------------------------------------------
    def _scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def requeue_excluding(self, exclude: list[str]) -> int:
        """Requeue this job with ``exclude`` added to its ExcNodeList (hold, update, release)."""
        job = self.alloc.job_id
        p = self._scontrol("requeuehold", job)
        if p.returncode != 0:
            log(f"scontrol requeuehold {job} failed: {(p.stderr or p.stdout).strip()}")
            return 1
        excl, updated, why = ",".join(exclude), False, ""
        have = job_info(job, self.env).get("ExcNodeList", "(null)")
        if have not in ("", "(null)"):  # keep what the job already excluded (sbatch --exclude)
            excl = ",".join(sorted({*exclude, *expand_nodelist(have)}))
        # ExcNodeList is refused while the job runs and accepted once requeuehold has taken; a
        # release sent too early is lost (seen on Slurm 22.05): repeat both until the job is
        # pending and not held. Slurm kills this batch script KillWait (30 s) after the requeue;
        # its SIGTERM is caught.
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            if not updated:
                p = self._scontrol("update", f"JobId={job}", f"ExcNodeList={excl}")
                updated, why = p.returncode == 0, (p.stderr or p.stdout).strip()
            if updated:
                self._scontrol("release", job)
                info = job_info(job, self.env)
                if info.get("Priority", "0") != "0" and "held" not in info.get("Reason", ""):
                    log(f"requeued Slurm job {job} excluding {excl}")
                    return EXIT_PREEMPTED
            time.sleep(0.3)
        log(
            f"requeue of Slurm job {job} excluding {excl} incomplete (ExcNodeList "
            f"{'set' if updated else 'not set: ' + why}; release it: scontrol release {job})"
        )
        return 1

    def srun(self, nodes: list[str], verdict_dir: Path) -> tuple[int, list[str]]:
        """Run the step on ``nodes``; srun's stderr passes through, its error lines are kept.
        ``self.first_exit``: when srun first reported a task that ended badly (None: none)."""
        self.first_exit = None
        argv = [
            "srun",
            "--kill-on-bad-exit=1",
            f"--nodes={len(nodes)}",
            f"--ntasks={len(nodes) * self.alloc.tasks_per_node}",
            f"--ntasks-per-node={self.alloc.tasks_per_node}",
            f"--nodelist={','.join(nodes)}",
            *self.cmd.srun_args,
            *self.cmd.argv,
        ]
        env = {**self.env, VERDICT_DIR: str(verdict_dir)}
        lines: list[str] = []
        killer: threading.Timer | None = None
        self._proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
        assert self._proc.stderr is not None
        for raw in self._proc.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            text = raw.decode(errors="replace").rstrip()
            if text.startswith("srun: "):
                lines.append(text)
                if self.first_exit is None and (
                    _SRUN_TASK.match(text) or _SRUN_TERMINATING.search(text)
                ):
                    self.first_exit = time.time()
                step = _STEP_ID.search(text)
                if step and killer is None and _SRUN_TERMINATING.search(text):
                    killer = threading.Timer(KILL_AFTER_S, self._kill_step, (step.group(1),))
                    killer.daemon = True
                    killer.start()
        rc = self._proc.wait()
        if killer is not None:
            killer.cancel()
        return rc, lines

    def _kill_step(self, step: str) -> None:
        """SIGKILL what is left of a step srun is ending: Slurm's SIGCONT + SIGTERM wakes a stopped
        rank into a broken collective and a dead store, which it may take the store timeout to
        give up on (seen: 18 s), and srun waits up to KillWait for it: the new step would wait
        too. The ranks that diagnosed the failure have written their verdicts by then."""
        if self._proc is not None and self._proc.poll() is None:
            subprocess.run(
                ["scancel", "--signal=KILL", step], env=self.env, capture_output=True, timeout=60
            )

    # -- the loop -------------------------------------------------------------------------------
    def _on_term(self, signum: int, _frame: Any) -> None:
        self.terminating = True  # srun got the same signal from Slurm: let it end the step

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):  # a preemption notice is the ranks' business
            signal.signal(
                sig, lambda *_: None
            )  # (a handler, not SIG_IGN: srun must not inherit it)
        alloc, nnodes = self.alloc, self.cmd.nnodes
        if nnodes > len(alloc.nodes):
            raise UserError(
                f"launch.nnodes={nnodes} but the allocation has {len(alloc.nodes)} nodes "
                f"({','.join(alloc.nodes)}): expected launch.nnodes <= the sbatch -N (the rest "
                "are spares)"
            )
        attempt_no = 0
        while True:
            quarantined = set(quarantine.exclude_list(self.qfile))
            nodes = choose_nodes(alloc.nodes, quarantined, nnodes)
            if nodes is None:
                bad = sorted(quarantined & set(alloc.nodes))
                log(
                    f"{len(alloc.nodes) - len(bad)} healthy nodes in the allocation, "
                    f"launch.nnodes={nnodes}: quarantined {','.join(bad)}"
                )
                return self.requeue_excluding(sorted(quarantined))
            attempt_no += 1
            tag = f"{alloc.job_id}.{alloc.restart}.{attempt_no}"
            verdict_dir = self.run_dir / "attempts" / tag
            spares = [n for n in alloc.nodes if n not in nodes and n not in quarantined]
            resumed_from = self.checkpoint_step()
            log(
                f"attempt {tag}: step on {','.join(nodes)} (spares: {','.join(spares) or 'none'}"
                f"; quarantined: {','.join(sorted(quarantined)) or 'none'}), from checkpoint "
                f"step {resumed_from}"
            )
            started = time.time()
            rc, srun_lines = self.srun(nodes, verdict_dir)
            ended = time.time()
            progress = self.checkpoint_step()
            logged = last_logged_step(self.cmd.output_dir, started)
            attempt: dict[str, Any] = {
                "attempt": tag,
                "nodes": nodes,
                "started_unix": started,
                "ended_unix": ended,
                "exit": rc,
                "resumed_from": resumed_from,
                "progress": progress,
                "died_at_step": max(progress, logged or 0),
            }
            for host, reason in replica_nodes(read_verdicts(verdict_dir), nodes).items():
                quarantine.record(self.qfile, [(host, reason)], "replica-vote")
                log(f"node {host} quarantined (replica-vote: {reason}) -> {self.qfile}")
            if rc == 0 or rc == EXIT_PREEMPTED or self.terminating:
                attempt["outcome"] = "completed" if rc == 0 else "stopped"
                self._finish(attempt)
                return rc
            if bad_input(srun_lines):
                attempt["outcome"] = "bad_input"
                self.record_attempt(attempt)
                log(
                    f"attempt {tag}: a rank exited {EXIT_BAD_INPUT} (bad input, see above): "
                    "not retrying"
                )
                return EXIT_BAD_INPUT
            verdicts = read_verdicts(verdict_dir, before=self.first_exit)
            named = bad_nodes(verdicts, nodes, srun_lines)
            for host, (reason, source) in named.items():
                quarantine.record(self.qfile, [(host, reason)], source)
                log(f"node {host} quarantined ({source}: {reason}) -> {self.qfile}")
            crashed = [f"rank {v['rank']}: {v['crashed']}" for v in verdicts if "crashed" in v]
            if not named:
                why = f"{crashed[0]}" if crashed else "no node named"
                log(f"attempt {tag}: step exited {rc} ({why}): a software error, same nodes again")
            attempt.update(outcome="died", bad_nodes={h: r for h, (r, _) in named.items()})
            attempts = self.record_attempt(attempt)
            why = crash_loop(attempts, self.crash_loop_k)
            if why:
                attempts[-1]["outcome"] = "died"
                self._mark_status("crash_loop")
                log(why)
                return 1

    def _finish(self, attempt: dict[str, Any]) -> None:
        attempts = self.record_attempt(attempt)
        # Recovery: from each death to the first step logged after it (failure detection by
        # the step timeout comes before the death and is not included).
        for prev, nxt in zip(attempts, attempts[1:], strict=False):
            if prev.get("outcome") == "died" and "recovery_s" not in prev:
                t = first_step_after(self.cmd.output_dir, float(nxt["started_unix"]))
                if t is not None:
                    prev["recovery_s"] = round(t - float(prev["ended_unix"]), 2)
                    log(
                        f"recovery after attempt {prev['attempt']}: {prev['recovery_s']:.1f} s "
                        "from the step's death to the next training step"
                    )
        if self.cmd.ckpt_dir:
            record = read_record(self.cmd.ckpt_dir)
            record["attempts"] = attempts
            write_record(self.cmd.ckpt_dir, record)

    def _mark_status(self, status: str) -> None:
        if self.cmd.ckpt_dir:
            record = read_record(self.cmd.ckpt_dir)
            record["status"] = status
            write_record(self.cmd.ckpt_dir, record)
