"""The hang verdict names the root cause: from every rank's heartbeat (step, phase, collectives
issued) it picks the ranks that stopped, else the rank that is behind; the line a failing rank
prints is what the launchers read back; identical error blocks of several ranks are printed once.
The end-to-end drills (a rank stuck in forward under `scaleout launch`, SIGSTOP) are in
tests/train/test_faults.py; the launcher's handling of these lines in
tests/launchers/test_launcher.py.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from scaleout.env.base import free_port
from scaleout.errors import UserError
from scaleout.goodput.verdict import read_verdict, srun_exits, verdict_line, with_exits
from scaleout.launchers.local import TracebackFolder
from scaleout.launchers.slurm import SlurmJob
from scaleout.train.faults import HangInjection
from scaleout.train.liveness import Heartbeat, Progress, judge


def _describe(r: int) -> str:
    return f"rank {r} (node {r // 2}, local rank {r % 2})"


def _beat(beat: int, step: int, phase: str, seq: int) -> dict:
    return {"beat": beat, "step": step, "phase": phase, "seq": seq}


@pytest.mark.unit
def test_the_rank_behind_is_named_with_where_everyone_is() -> None:
    """Every heartbeat alive; rank 3 still in step 12's forward, one collective short of the
    others, who wait in the gradient sync: rank 3 is the culprit (before: "every rank's heartbeat
    is alive", no rank named)."""
    first = [_beat(5, 12, "grad-sync", 41)] * 3 + [_beat(5, 12, "forward", 40)]
    second = [_beat(7, 12, "grad-sync", 41)] * 3 + [_beat(7, 12, "forward", 40)]
    v = judge(first, second, 2.0, _describe)
    assert v["culprits"] == [3]
    assert v["text"] == (
        "rank 3 (node 1, local rank 1) is behind: step 12 in forward, collective #40 while the "
        "others are at #41 (step 12, grad-sync)"
    )


@pytest.mark.unit
def test_behind_is_lowest_step_then_fewest_collectives_then_earliest_phase() -> None:
    def culprits(points: list[tuple[int, str, int]]) -> list[int]:
        beats = [_beat(1, s, p, q) for s, p, q in points]
        return judge([_beat(0, 0, "init", 0)] * len(points), beats, 2.0, _describe)["culprits"]

    # a step behind outweighs more collectives (stuck in the data loader of the previous step)
    assert culprits([(5, "grad-sync", 20), (4, "data", 30), (5, "grad-sync", 20)]) == [1]
    # same step: fewer collectives issued
    assert culprits([(5, "backward", 21), (5, "grad-sync", 21), (5, "forward", 20)]) == [2]
    # same step and count: the earlier phase
    assert culprits([(5, "forward", 20), (5, "data", 20), (5, "forward", 20)]) == [1]
    # two ranks behind together, the others split: "2 of the other 3"
    beats = [_beat(1, *p) for p in [(5, "data", 9), (5, "data", 9), (6, "data", 11)]]
    beats += [_beat(1, 6, "agreement", 12), _beat(1, 6, "data", 11)]
    v = judge([_beat(0, 0, "init", 0)] * 5, beats, 2.0, _describe)
    assert v["culprits"] == [0, 1]
    assert (
        " are behind: step 5 in data, collective #9 while 2 of the other 3 are at #11 " in v["text"]
    )


@pytest.mark.unit
def test_a_stopped_heartbeat_outranks_being_behind_and_all_equal_names_nobody() -> None:
    first = [_beat(3, 7, "grad-sync", 30), _beat(3, 7, "forward", 29), _beat(3, 7, "grad-sync", 30)]
    moved = [_beat(4, 7, "grad-sync", 30), _beat(4, 7, "forward", 29), _beat(3, 7, "grad-sync", 30)]
    v = judge(first, moved, 4.0, _describe)
    assert v["culprits"] == [2]  # its counter did not move: stopped, although rank 1 is behind
    assert v["text"] == (
        "rank 2 (node 1, local rank 0) (last seen at step 7 in grad-sync, collective #30) sent no "
        "heartbeat for 4 s: stopped, hung or dead"
    )
    never = judge(first[:2] + [None], moved[:2] + [None], 4.0, _describe)
    assert never["culprits"] == [2] and "rank 2 (node 1, local rank 0) sent no" in never["text"]
    same = [_beat(9, 7, "grad-sync", 30)] * 3
    v = judge(first, same, 4.0, _describe)
    assert v["culprits"] == [] and v["text"].startswith("every rank's heartbeat is alive, all at")


@pytest.mark.unit
def test_progress_counts_the_watched_sync_and_its_wait() -> None:
    p = Progress()
    sync = SimpleNamespace(issued=0, waiting=False)
    p.watch(sync)
    p.at(3, "backward")
    p.collectives += 2
    sync.issued = 5
    assert p.snapshot() == {"step": 3, "phase": "backward", "seq": 7}
    sync.waiting = True
    assert p.snapshot() == {"step": 3, "phase": "grad-sync", "seq": 7}


@pytest.mark.unit
def test_the_heartbeat_publishes_progress_and_follows_a_shorter_period() -> None:
    """The period starts at 30 s (the init timeout's) and drops to 1 s, as after the first step:
    a beat with the rank's progress must follow within about a second (before: the thread slept
    out the 30 s wait, so a run failing in its first 30 s showed every rank as stopped)."""
    port = free_port("127.0.0.1")
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    world = SimpleNamespace(world_size=2, rank=1, master_addr="127.0.0.1", master_port=port)
    period = [30.0]
    hb = Heartbeat(world, lambda: period[0])  # type: ignore[arg-type]
    try:
        hb.at(4, "forward")
        period[0] = 1.0
        deadline = time.monotonic() + 4.0
        beat: dict = {}
        while time.monotonic() < deadline and beat.get("beat", 0) < 1:
            time.sleep(0.1)
            beat = json.loads(master.get("scaleout/heartbeat/1").decode())
        assert beat == {"beat": 1, "step": 4, "phase": "forward", "seq": 0}, beat
    finally:
        hb.close()


@pytest.mark.unit
def test_verdict_line_round_trips_and_slurm_reads_it_from_the_job_output(tmp_path: Path) -> None:
    text = "rank 3 (node 1, local rank 1) is behind: step 2 in forward, collective #4 while ..."
    line = verdict_line("rank 1 (node 0, local rank 1)", text)
    assert read_verdict(line) == text
    assert read_verdict("[rank 1] " + line) is None  # the launcher strips its prefix first
    assert read_verdict("scaleout: rank 1 (node 0, local rank 1): a collective failed") is None
    log = tmp_path / "slurm.out"
    log.write_text(f"step 1 ...\n{line}\n{verdict_line('rank 0 (node 0, local rank 0)', 'x')}\n")
    assert SlurmJob(1, {}, 60.0, log=log)._verdict() == text
    assert SlurmJob(1, {}, 60.0, log=tmp_path / "missing")._verdict() is None


@pytest.mark.unit
def test_a_silent_rank_the_launcher_saw_exit_is_said_to_have_crashed(tmp_path: Path) -> None:
    """The peers' verdict can only say a rank "sent no heartbeat: stopped, hung or dead"; when
    the launcher knows that rank ended (its exit code, or srun's line in a Slurm job's output)
    the sentence says it crashed and how. Other verdicts and other ranks' exits leave it as is."""
    first = [_beat(3, 7, "grad-sync", 30)] * 2 + [_beat(3, 7, "forward", 29)] * 2
    second = [_beat(4, 7, "grad-sync", 30)] * 2 + [_beat(3, 7, "forward", 29)] * 2
    text = judge(first, second, 4.0, _describe)["text"]
    where = "(last seen at step 7 in forward, collective #29)"
    assert with_exits(text, {3: "was killed by SIGKILL", 2: "exited with code 1"}) == (
        f"rank 2 (node 1, local rank 0) {where}, rank 3 (node 1, local rank 1) {where} crashed "
        "(rank 2 exited with code 1, rank 3 was killed by SIGKILL): its heartbeat ended with it"
    )
    part = with_exits(text, {3: "was killed by SIGKILL"})
    assert part.endswith(
        "sent no heartbeat for 4 s: rank 3 was killed by SIGKILL (crashed), the others stopped, "
        "hung or dead"
    )
    assert with_exits(text, {0: "exited with code 1"}) == text
    behind = "rank 3 (node 1, local rank 1) is behind: step 2 in forward, collective #4 while ..."
    assert with_exits(behind, {3: "exited with code 1"}) == behind
    log = tmp_path / "slurm.out"
    lines = [
        verdict_line("rank 0 (node 0, local rank 0)", text),
        "srun: error: n2: tasks 2-3: Killed",
        "srun: launch/slurm: _step_signal: Terminating StepId=224.0",
        "srun: error: n1: task 0: Exited with exit code 1",
    ]
    log.write_text("\n".join(lines) + "\n")
    assert srun_exits(lines) == {2: "ended on n2: Killed", 3: "ended on n2: Killed"}
    assert (
        SlurmJob(1, {}, 60.0, log=log)
        ._verdict()
        .endswith(
            "crashed (rank 2 ended on n2: Killed, rank 3 ended on n2: Killed): its heartbeat ended "
            "with it"
        )
    )


@pytest.mark.unit
def test_hang_injection_parses_its_variable() -> None:
    env = {HangInjection.VARIABLE: "3:3:forward,5:1:data:stop,6:3:eval:stop"}
    assert HangInjection.from_env(3, env).points == {(3, "forward"): False, (6, "eval"): True}
    assert HangInjection.from_env(1, env).points == {(5, "data"): True}
    assert HangInjection.from_env(0, env) is None
    for bad in ("3:3:fwd", "3:3", "x:3:data", "3:3:data:pause"):
        with pytest.raises(UserError, match=rf"SCALEOUT_TEST_HANG='{bad}': expected STEP:RANK"):
            HangInjection.from_env(3, {HangInjection.VARIABLE: bad})


_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/x/trainer.py", line 12, in train',
    "    dist.all_reduce(t)",
    "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
    "Exception raised from recvBytes at c10d/Utils.hpp:682 (most recent call first):",
    "frame #0: c10::Error::Error() + 0x98 (0x{addr:x} in /x/libc10.so)",
    "frame #1: <unknown function> + 0x5a1 (0x{addr:x} in /x/libtorch_cpu.so)",
    "",
]


@pytest.mark.unit
def test_identical_error_blocks_of_several_ranks_are_printed_once() -> None:
    """Ranks 0, 1, 2 print the same traceback with its C++ frames (addresses differ per process),
    interleaved with their own lines; rank 3 prints a different one. Printed: rank 0's in full,
    one line for each of ranks 1 and 2, rank 3's in full, every other line as it came; the summary
    names the ranks (before: every rank's copy in full)."""
    folder = TracebackFolder()
    out: list[tuple[int, str]] = []
    for rank in (0, 1, 2, 3):
        block = [x.format(addr=0x7F0000 + 0x1000 * rank) for x in _TRACEBACK]
        if rank == 3:
            block[3] = "RuntimeError: something else"
        out += folder.feed(rank, f"step 5 on rank {rank}")
        for x in block:
            out += folder.feed(rank, x)
        out += folder.feed(rank, "scaleout: after the block")
    for rank in (0, 1, 2, 3):
        out += folder.close(rank)
    printed = [f"[rank {r}] {x}" for r, x in out]
    block_lines = len(_TRACEBACK) - 1  # the trailing blank line is not part of the block
    assert printed.count("[rank 0] Traceback (most recent call last):") == 1
    assert "[rank 1] Traceback (most recent call last):" not in printed
    assert f"[rank 1] (the same {block_lines}-line error block as [rank 0] above)" in printed
    assert f"[rank 2] (the same {block_lines}-line error block as [rank 0] above)" in printed
    assert "[rank 3] RuntimeError: something else" in printed
    assert [x for x in printed if x.startswith("[rank 2]")] == [
        "[rank 2] step 5 on rank 2",
        f"[rank 2] (the same {block_lines}-line error block as [rank 0] above)",
        "[rank 2] scaleout: after the block",
    ]
    assert len(printed) == 4 * 2 + 2 * block_lines + 2
    assert folder.summary() == [
        "the error block printed under [rank 0] was the same on ranks 0,1,2"
    ]


@pytest.mark.unit
def test_a_block_cut_off_by_the_end_of_output_is_still_printed() -> None:
    folder = TracebackFolder()
    assert folder.feed(1, "Exception raised from x at y.cpp:1") == []
    assert folder.feed(1, "frame #0: f + 0x1 (0x2 in z.so)") == []
    assert folder.close(1) == [
        (1, "Exception raised from x at y.cpp:1"),
        (1, "frame #0: f + 0x1 (0x2 in z.so)"),
    ]
    assert folder.close(1) == [] and folder.summary() == []


@pytest.mark.unit
def test_a_stopped_ranks_position_is_current_though_its_last_beat_is_a_period_old() -> None:
    """Stopped at step 16, its last beat (one per period) said step 2: the collective the live
    ranks wait in says how far it really got (the review's "last seen at step 2")."""
    first = [_beat(8, 16, "grad-sync", 61), _beat(8, 16, "grad-sync", 61), _beat(1, 2, "data", 5)]
    moved = [_beat(9, 16, "grad-sync", 61), _beat(9, 16, "grad-sync", 61), _beat(1, 2, "data", 5)]
    v = judge(first, moved, 4.0, _describe)
    assert v["culprits"] == [2]
    assert (
        "rank 2 (node 1, local rank 0) (last seen at step 2 in data, collective #5; it then took "
        "part in every collective up to #60: the others wait for it in #61 at step 16, grad-sync) "
        "sent no heartbeat for 4 s" in v["text"]
    )
