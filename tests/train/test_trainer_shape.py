"""The trainer's honest interfaces (issue 40): it asks the gradient sync through its protocol and
never which one it holds, plants no callback on another object, declares every attribute it sets,
holds the test-only faults behind one object and leaves the save cadence to the SaveSchedule."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from scaleout.checkpoint import Checkpointer
from scaleout.checkpoint_schedule import SaveSchedule
from scaleout.optim.sharded import ShardedLAMB
from scaleout.parallel import DataParallel
from scaleout.parallel.sync import GradientSync
from scaleout.train.faults import (
    CorruptInjection,
    CrashInjection,
    DelayInjection,
    HangInjection,
    Injections,
    ReducedNanInjection,
)

pytestmark = pytest.mark.unit

TRAINER = Path(__file__).resolve().parents[2] / "scaleout" / "train" / "trainer.py"
# Data, not callbacks: rank 0's node names for the stragglers' verdicts (SkewTracker reads them),
# and the switch of the phase clock the agreement reads (on for the run's duration).
ASSIGNED_ELSEWHERE_ALLOWED = {"self.skew.node_names", "CLOCK.enabled"}


def _trainer_class() -> ast.ClassDef:
    tree = ast.parse(TRAINER.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")


def test_the_trainer_never_asks_which_sync_it_holds() -> None:
    src = TRAINER.read_text()
    found = [
        f"trainer.py:{i}: {line.strip()}"
        for i, line in enumerate(src.splitlines(), 1)
        if re.search(r"self\.sync is|self\.model\.reducer\.|rider_fill|\.fault\b", line)
    ]
    assert not found, found


def test_the_trainer_plants_no_attribute_on_another_object() -> None:
    """``x.attr = ...`` only on ``self``: a callback goes through a method of the protocol."""
    planted = []
    for node in ast.walk(_trainer_class()):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            for sub in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(sub, ast.Attribute) and not (
                    isinstance(sub.value, ast.Name) and sub.value.id == "self"
                ):
                    name = ast.unparse(sub)
                    if name not in ASSIGNED_ELSEWHERE_ALLOWED:
                        planted.append(f"trainer.py:{node.lineno}: {name}")
    assert not planted, planted


def test_every_trainer_attribute_is_declared_on_the_class() -> None:
    cls = _trainer_class()
    declared = {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    properties = {
        f.name
        for f in cls.body
        if isinstance(f, ast.FunctionDef)
        and any(ast.unparse(d) == "property" for d in f.decorator_list)
    }
    assigned = {
        sub.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for sub in ast.walk(t)
        if isinstance(sub, ast.Attribute)
        and isinstance(sub.value, ast.Name)
        and sub.value.id == "self"
    }
    undeclared = sorted(assigned - declared - properties)
    assert not undeclared, f"Trainer sets undeclared attributes: {undeclared}"


@pytest.mark.parametrize("sync", [DataParallel, ShardedLAMB])
def test_both_syncs_answer_what_the_trainer_asks(sync: type) -> None:
    asked = [
        n for n in {*vars(GradientSync), *GradientSync.__annotations__} if not n.startswith("_")
    ]
    assert {"reduced_grads", "nonfinite_flag", "ride", "ride_result", "while_waiting"} <= set(asked)
    missing = [n for n in asked if n != "last_stats" and not hasattr(sync, n)]
    assert not missing, f"{sync.__name__} lacks {missing}"
    assert isinstance(sync.finds_nonfinite, bool) and isinstance(sync.grads_are_views, bool)


def test_injections_read_every_variable_once() -> None:
    env = {
        "SCALEOUT_INJECT_NAN": "3:1",
        "SCALEOUT_INJECT_NAN_REDUCED": "2:1,5:0",
        "SCALEOUT_INJECT_CRASH": "4:1",
        "SCALEOUT_INJECT_CORRUPT": "1:1",
        "SCALEOUT_TEST_HANG": "2:1:forward",
        "SCALEOUT_TEST_DELAY": "1:data:20",
        "SCALEOUT_TEST_REQUEUE_DELAY_S": "1.5",
    }
    mine = Injections.from_env(1, env)
    assert mine.active and mine.nan is not None and mine.nan.steps == {3}
    # applied in this order: a NaN after the reduction, a crash, a silent corruption
    kinds = [type(f) for f in mine.gradient_faults]
    assert kinds == [ReducedNanInjection, CrashInjection, CorruptInjection]
    assert isinstance(mine.hang, HangInjection) and mine.hang.points == {(2, "forward"): False}
    assert isinstance(mine.delay, DelayInjection) and mine.delay.seconds == {"data": 0.02}
    assert mine.requeue_delay is not None and mine.requeue_delay.seconds == 1.5
    other = Injections.from_env(0, env)  # rank 0: only its own reduced NaN (and the requeue)
    assert [type(f) for f in other.gradient_faults] == [ReducedNanInjection]
    assert other.nan is None and other.hang is None and other.delay is None
    none = Injections.from_env(0, {})
    assert not none.active and none.gradient_faults == () and none == Injections()


def test_save_schedule_due(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep=1, rank=0)
    every3 = SaveSchedule(ck, None, 3, mtbf_h=5000.0, settle_timeout_s=60.0)  # type: ignore[arg-type]
    assert [s for s in range(1, 10) if every3.due(s)] == [3, 6, 9]
    never = SaveSchedule(ck, None, 0, mtbf_h=5000.0, settle_timeout_s=60.0)  # type: ignore[arg-type]
    assert not any(never.due(s) for s in range(1, 10))
    # auto: the first save one step after this run's start, then `every` after the last save
    auto = SaveSchedule(ck, None, "auto", 5000.0, 60.0, start_step=7)  # type: ignore[arg-type]
    assert not auto.due(7) and auto.due(8)
    auto.saved_step, auto.every = 8, 4
    assert [s for s in range(9, 17) if auto.due(s)] == [12, 13, 14, 15, 16]


def test_data_parallel_answers_through_methods_once_per_synchronisation() -> None:
    """One rank, real buckets: an offered rider is written once and read back summed; work given
    to while_waiting runs in that backward's wait only; zero_grad keeps .grad views into the
    buffers that reduced_grads returns."""
    import torch

    from scaleout.config.schema import CommConfig
    from scaleout.world import init

    world = init(environment="single")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        dp = DataParallel.from_config(model, world, CommConfig(bucket_mb=25.0), rider=3)
        written, ran = [], []

        def fill(view: torch.Tensor) -> None:
            written.append(view.numel())
            view.copy_(torch.tensor([1.0, 2.0, 3.0]))

        assert dp.ride(fill) is True
        dp.while_waiting(lambda: ran.append(1))
        dp(torch.randn(4, 8)).sum().backward()
        assert written == [3] and ran == [1]
        assert dp.ride_result().tolist() == [1.0, 2.0, 3.0]  # one rank: the sums are the values
        grads = dp.reduced_grads()
        assert sum(g.numel() for g in grads) == sum(p.numel() for p in model.parameters())
        assert all(g.abs().sum() > 0 for g in grads)
        dp.zero_grad()
        assert all(g.abs().sum() == 0 for g in grads)
        assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in model.parameters())
        dp(torch.randn(4, 8)).sum().backward()  # nothing offered: nothing rides, nothing runs
        assert written == [3] and ran == [1] and dp.ride_result() is None
        assert dp.ride(None) is False
    finally:
        world.close()
