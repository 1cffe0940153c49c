"""The one-pass LAMB/LARS kernels compile before MLPerf's run_start (scaleout/optim/warmup.py).

The compile itself needs CUDA (or ``fused.COMPILE_DEVICES={"cpu"}``, which runs the CUDA kernels'
code on the CPU); the tests record ``fused.run_compiled``'s calls instead of compiling, which on
this 2-core machine would take minutes: what is checked is *when* the compiled kernels are first
run, and that the warm-up leaves the run's parameters and state alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from scaleout.optim import fused
from scaleout.optim.lamb import LAMB
from scaleout.optim.lars import LARS
from scaleout.optim.warmup import compiles, warm_up
from tests.distutil import run_dist
from tests.train.test_prefetch import SMALL_BERT


class _Recorder:
    """Stands in for ``fused.run_compiled``: records each call, runs the function eagerly."""

    def __init__(self, log: list[Any]):
        self.log = log

    def __call__(self, fn: Any, *args: Any) -> Any:
        self.log.append(("compiled", fn.__name__))
        return fn(*args)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    log: list[Any] = []
    monkeypatch.setattr(fused, "COMPILE_DEVICES", {"cpu"})
    monkeypatch.setattr(fused, "run_compiled", _Recorder(log))
    return log


@pytest.mark.unit
@pytest.mark.parametrize("make", [LAMB, LARS], ids=["lamb", "lars"])
def test_warm_up_runs_the_compiled_kernels_on_a_copy(recorded: list[Any], make: Any) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = make([{"params": params[:1], "weight_decay": 0.01}, {"params": params[1:]}], lr=0.1,
               onepass=True)  # fmt: skip
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # real state, so that the warm-up's copy has some to leave alone
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    steps = [g.get("step") for g in opt.param_groups]
    recorded.clear()
    assert compiles(opt)
    assert warm_up(opt) is not None
    assert recorded, "the warm-up ran no compiled kernel"
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p, b)
    after = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert [g.get("step") for g in opt.param_groups] == steps


@pytest.mark.unit
def test_nothing_to_warm_up_without_compiled_kernels(recorded: list[Any]) -> None:
    params = [torch.nn.Parameter(torch.randn(4))]
    assert warm_up(LAMB(params, onepass=False)) is None
    fused.COMPILE_DEVICES.clear()
    assert warm_up(LAMB(params, onepass=True)) is None  # CPU, not a compiled device
    assert recorded == []


def _trained(world: Any, out: str) -> list[Any]:
    """One rank of a tiny BERT run with the one-pass LAMB on a compiled device, recording the
    order of MLPerf's run_start and of the compiled kernels' calls."""
    from scaleout.config.load import load_config
    from scaleout.telemetry.mlperf import MLPerfLogger
    from scaleout.train.trainer import Trainer

    order: list[Any] = []
    saved = (MLPerfLogger.run_start, fused.run_compiled, set(fused.COMPILE_DEVICES))

    def run_start(self: Any) -> None:
        order.append(("run_start", ""))
        saved[0](self)

    MLPerfLogger.run_start = run_start
    fused.run_compiled = _Recorder(order)
    fused.COMPILE_DEVICES.add("cpu")
    try:
        cfg = load_config(
            None,
            [*SMALL_BERT, "optim.name=lamb", "train.max_steps=2", "train.progress=false",
             f"train.output_dir={out}", "data.num_workers=0"],
        )  # fmt: skip
        trainer = Trainer(cfg, world)
        trainer.optimizer.onepass = True  # what LAMB does on CUDA (no config key: automatic)
        trainer.train()
    finally:
        MLPerfLogger.run_start, fused.run_compiled = saved[0], saved[1]
        fused.COMPILE_DEVICES.clear()
        fused.COMPILE_DEVICES.update(saved[2])
    return order


@pytest.mark.multi_process
def test_optimizer_compiles_before_run_start(tmp_path: Any) -> None:
    """Base commit: the first compiled call comes with the first optimizer step, after
    run_start."""
    (order,) = run_dist(_trained, nnodes=1, nproc_per_node=1, args=(str(tmp_path),), timeout=300)
    names = [k for k, _ in order]
    assert "run_start" in names and "compiled" in names, names
    assert names.index("compiled") < names.index("run_start"), names
