"""What every benchmark shares: its standard flags, the interleaved measurement, the comparison with
the baseline measured in the same run, and the output (a Markdown table on stdout, JSON, an optional
PNG).

A benchmark is then only its variants::

    samples = interleave({"eager": step_eager, "compiled": step_compiled}, args.repeats,
    args.warmup)
    rows = compare(samples, baseline="eager")
    emit(args, NAME, ["variant", "median ms", "speed-up"], [[r.name, r.median_s * 1e3, r.speedup]
    for r in rows],
         {"rows": [r.to_dict() for r in rows]})

Interleaving: every timed round runs every variant once, in the given order on even rounds and
reversed on odd ones, so machine noise and slow drift (other jobs, thermal, caches) hit every
variant alike. In ranks (``world``), each call starts after a barrier and counts as the slowest
rank's time: a step ends when the last rank's does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import scaleout
from scaleout.errors import UserError
from scaleout.output import format_table, pyplot, save_figure, write_json

if TYPE_CHECKING:
    from scaleout.world import World


@dataclass
class Timing:
    """One timed call of a variant."""

    wall: float  # seconds (in ranks: the slowest rank's)
    # seconds of this thread's CPU time (time.thread_time: robust to other jobs on the machine)
    cpu: float
    value: Any = None  # what the variant returned (a loss, its own stats)


Samples = dict[Hashable, list[Timing]]


def interleave(
    variants: Mapping[Hashable, Callable[[], Any]],
    repeats: int,
    warmup: int = 0,
    *,
    world: World | None = None,
    slowest: bool = True,
    alternate: bool = True,
    after_round: Callable[[int], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> Samples:
    """``warmup`` untimed rounds, then ``repeats`` timed rounds of every variant (see the module
    docstring). ``slowest=False``: in ranks, still a barrier before each call, but this rank's
    own time. ``after_round(i)`` runs after timed round i (a measurement that belongs to the
    round, e.g. the communication alone); ``say`` gets one progress line per round."""
    out: Samples = {k: [] for k in variants}
    order = list(variants)
    for r in range(warmup + repeats):
        for key in order if (r % 2 == 0 or not alternate) else order[::-1]:
            timing = _timed(variants[key], world, slowest)
            if r >= warmup:
                out[key].append(timing)
        if r >= warmup and after_round is not None:
            after_round(r - warmup)
        if say is not None:
            done = f"round {r + 1}/{warmup + repeats}" + (" (warm-up)" if r < warmup else "")
            last = ", ".join(
                f"{k} {v[-1].wall * 1e3:.1f} ms" for k, v in out.items() if v and r >= warmup
            )
            say(f"  {done}" + (f": {last}" if last else ""))
    return out


def _timed(fn: Callable[[], Any], world: World | None, slowest: bool = True) -> Timing:
    if world is not None:
        world.barrier()
    t, c = time.perf_counter(), time.thread_time()
    value = fn()
    wall, cpu = time.perf_counter() - t, time.thread_time() - c
    if world is not None and slowest:
        wall = reduce_max(world, [wall])[0]
    return Timing(wall, cpu, value)


def reduce_max(world: World, values: Sequence[float]) -> list[float]:
    """The largest of every rank's ``values`` (elementwise): one all-reduce on the world's
    device."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=world.device)
    if world.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


@dataclass
class Row:
    """One variant against the baseline of the same run."""

    name: Any
    median_s: float
    min_s: float
    max_s: float
    cpu_median_s: float
    speedup: float  # baseline median / this median (wall)
    paired_speedup: float  # median over rounds of baseline / this, round by round (wall)
    cpu_speedup: float  # the same by thread CPU time
    times_s: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(samples: Samples, baseline: Hashable) -> list[Row]:
    """Median, min, max and speed-ups against ``baseline`` of every variant (the baseline
    included, at 1.0)."""
    base = samples[baseline]
    rows = []
    for name, ts in samples.items():
        wall, cpu = [t.wall for t in ts], [t.cpu for t in ts]
        rows.append(
            Row(
                name=name,
                median_s=statistics.median(wall),
                min_s=min(wall),
                max_s=max(wall),
                cpu_median_s=statistics.median(cpu),
                speedup=statistics.median(t.wall for t in base)
                / max(statistics.median(wall), 1e-12),
                paired_speedup=paired(base, ts, "wall"),
                cpu_speedup=paired(base, ts, "cpu"),
                times_s=wall,
            )
        )
    return rows


def paired(base: Sequence[Timing], other: Sequence[Timing], clock: str = "wall") -> float:
    """The median over rounds of base / other: a ratio of two calls of the same round, so slow drift
    cancels out."""
    return statistics.median(
        getattr(b, clock) / max(getattr(o, clock), 1e-12) for b, o in zip(base, other, strict=True)
    )


def sum_rounds(samples: Samples, group: Callable[[Hashable], Hashable]) -> Samples:
    """Variants summed round by round into groups (``group(key)``): e.g. the batches of one mode."""
    out: Samples = {}
    for key, ts in samples.items():
        acc = out.setdefault(group(key), [Timing(0.0, 0.0) for _ in ts])
        for a, t in zip(acc, ts, strict=True):
            a.wall += t.wall
            a.cpu += t.cpu
    return out


# -- flags
# --------------------------------------------------------------------------------------------
def add_standard_arguments(
    p: argparse.ArgumentParser,
    name: str,
    *,
    repeats: int | None = None,
    warmup: int | None = None,
    png: bool = False,
    threads: int | None = None,
) -> None:
    """``--out`` (JSON), and where the benchmark has them: ``--repeats``, ``--warmup``,
    ``--png``, ``--threads``."""
    if repeats is not None:
        p.add_argument(
            "--repeats",
            type=int,
            default=repeats,
            help=f"timed rounds; medians reported (default {repeats})",
        )
    if warmup is not None:
        p.add_argument(
            "--warmup", type=int, default=warmup, help=f"untimed rounds first (default {warmup})"
        )
    if threads is not None:
        p.add_argument(
            "--threads",
            type=int,
            default=threads,
            help="torch threads (default "
            f"{threads}{': then thread-CPU time is robust to other jobs' if threads == 1 else ''}; "
            "0 = torch's default)",
        )
    p.add_argument("--out", default=f"bench-results/{name}.json", help="JSON output ('' = none)")
    if png:
        p.add_argument(
            "--png", default=f"bench-results/{name}.png", help="PNG ('' = none; needs matplotlib)"
        )


# The BERT-layer benchmarks' (overlap, sharded-overlap) tiny settings for tests/bench/test_bench.py.
BERT_LAYER_SMOKE_ARGS = [
    *("--nnodes", "1", "--nproc-per-node", "2", "--layers", "1", "--seq", "8"),
    *("--batch", "1", "--repeats", "1", "--warmup", "0"),
]


def add_bert_layer_arguments(p: argparse.ArgumentParser) -> None:
    """``--layers`` and ``--seq`` of the benchmarks that time BERT-base-shaped encoder layers
    (``bench.overlap.bert_like``); each adds its own ``--batch`` and ``--bucket-mb``."""
    p.add_argument(
        "--layers",
        type=int,
        default=2,
        help="BERT-base-shaped encoder layers (default 2: 14.2M params, 57 MB)",
    )
    p.add_argument(
        "--seq", type=int, default=128, help="sequence length (default 128, BERT phase 1)"
    )


def add_config_arguments(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """``--config`` and the positional ``key=value`` overrides of a benchmark that trains or
    builds from a config: the config's keys are set there, never as flags of their own
    (tests/cli/test_cli_surface.py)."""
    p.add_argument("--config", default=default, help=f"{what} (default {default})")
    p.add_argument(
        "overrides",
        nargs="*",
        help="config overrides key=value (they win over the benchmark's defaults), e.g. "
        "model.bert.layers=1 train.target=0.1",
    )


def bench_config(
    args: argparse.Namespace, defaults: Sequence[str] = (), bench_keys: Sequence[str] = ()
) -> Any:
    """``args.config`` + the benchmark's ``defaults`` + ``args.overrides`` (they win), validated.
    An override of a key the benchmark sets for every run itself (``bench_keys``) would be
    silently replaced, so it is refused. Raises UserError, one line naming the key, before
    anything runs."""
    from scaleout.config import load_config, parse_overrides  # deferred: a fast `scaleout --help`

    for keys, _ in parse_overrides(args.overrides):
        if ".".join(keys) in bench_keys:
            raise UserError(
                f"override {'.'.join(keys)}: the benchmark sets it for every run (see its --help)"
            )
    return load_config(args.config, [*defaults, *args.overrides])


def check_counts(args: argparse.Namespace, **least: int) -> None:
    """One line naming every flag below its least value (``repeats=1, warmup=0``...)."""

    bad = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k, lo in least.items()
        if getattr(args, k) < lo
    ]
    if bad:
        want = ", ".join(f"--{k.replace('_', '-')} >= {lo}" for k, lo in least.items())
        raise UserError(f"{' '.join(bad)}: expected {want}")


def set_threads(args: argparse.Namespace) -> None:
    """``--threads`` (0: torch's default)."""
    import torch

    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)


# -- output
# -------------------------------------------------------------------------------------------
def emit(
    args: argparse.Namespace,
    bench: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    payload: dict[str, Any],
    *,
    notes: Sequence[str] = (),
    plot: Callable[[Any], Any] | None = None,
    world: World | None = None,
) -> Path | None:
    """On rank 0 (or without ranks): the table and ``notes`` on stdout, ``payload`` as JSON at
    ``--out`` (with the machine, the command and ``bench``), and ``plot(plt) -> figure`` as PNG
    at ``--png``."""
    if world is not None and world.rank != 0:
        return None
    print(format_table(headers, rows), flush=True)
    for line in notes:
        print(line, flush=True)
    path = write_json(
        getattr(args, "out", None),
        {"bench": bench, "command": "scaleout " + " ".join(sys.argv[1:]), **payload},
    )
    if path:
        print(f"wrote {path}", flush=True)
    png = getattr(args, "png", None)
    if png and plot is not None:
        plt = pyplot()
        if plt is not None:
            save_figure(plot(plt), png)
    return path


# -- one-shot: a bench that runs inside ranks can also start them itself
# ------------------------------
_ONE_SHOT = {"--nnodes": True, "--nproc-per-node": True, "--netns": False, "--rate": True}


def add_one_shot_arguments(p: argparse.ArgumentParser) -> None:
    """``--nnodes/--nproc-per-node/--netns/--rate``: start the ranks from here (see
    :func:`in_ranks`)."""
    one = p.add_argument_group("one-shot (start the ranks from here)")
    one.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="start this many emulated nodes via scaleout launch",
    )
    one.add_argument(
        "--nproc-per-node", type=int, default=1, help="ranks per emulated node (one-shot)"
    )
    one.add_argument(
        "--netns",
        action="store_true",
        help="one-shot in an emulated cluster (root): up, run, always down",
    )
    one.add_argument(
        "--rate", default="1gbit", help="link rate of the emulated cluster (default 1gbit)"
    )


def add_rank_arguments(
    p: argparse.ArgumentParser, name: str, *, repeats: int, warmup: int, png: bool = False
) -> None:
    """A benchmark that runs in ranks: the standard flags and the one-shot ones."""
    add_standard_arguments(p, name, repeats=repeats, warmup=warmup, png=png)
    add_one_shot_arguments(p)


def in_ranks(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """``body(args)`` in this rank, or, with ``--nnodes``, this very command line re-run inside
    ``scaleout launch`` minus the one-shot flags. A subprocess, so rank-side code never imports
    ``launchers``; every other flag passes through unchanged, and relative paths still resolve
    (ranks inherit the working directory, also inside namespaces)."""
    if args.nnodes is None:
        return body(args)
    argv, rest, i = list(args._argv), [], 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        if flag in _ONE_SHOT:
            i += 1 if inline or not _ONE_SHOT[flag] else 2
            continue
        rest.append(argv[i])
        i += 1
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        str(args.nnodes),
        "--nproc-per-node",
        str(args.nproc_per_node),
    ]
    if args.netns:
        cmd += ["--netns", "--rate", args.rate]
    return subprocess.run([*cmd, "--", "scaleout", *rest]).returncode


def init_ranks(at_least: int, bench: str) -> World:
    """The World of a bench that runs in ranks (torch threads from OMP_NUM_THREADS, as the
    launcher set)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = scaleout.init()
    if world.world_size < at_least:
        world.close()
        raise UserError(
            f"scaleout bench {bench} needs >= {at_least} ranks (e.g. --nnodes 2 --nproc-per-node 2 "
            "--netns)"
        )
    return world


def say0(world: World | None) -> Callable[..., None]:
    """print on rank 0 (or without ranks), nothing elsewhere."""
    if world is not None and world.rank != 0:
        return lambda *a: None
    return lambda *a: print(*a, flush=True)
