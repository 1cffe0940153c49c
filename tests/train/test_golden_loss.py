"""The tiny config's first 20 training losses against stored golden values (as torchtitan keeps
golden losses): any change to the model, the data order, packing, the optimizer, the schedule or the
loop that moves the numbers shows up here, before a long run would show it.

The run: ``bert_tiny_cpu`` on its synthetic data (deterministic from the seed, no corpus download or
tokenizer training), one process, ``train.deterministic=true``, 1 torch thread, global batch 8,
LAMB. Regenerate after an intended change, and say why in the commit::

python tests/train/test_golden_loss.py --write

Tolerance (``RTOL``): the same run is bitwise-repeatable on one machine; across machines, CPU
kernels (oneDNN/MKL vectorisation width, FMA) change float summation order. Measured on this
machine, running the same 20 steps with 2 torch threads instead of 1 (another reduction order) moves
the losses by at most ``threads_drift`` relative; the smallest real change we want caught, LAMB's
learning rate 1 % higher, moves them by ``lr_1pct`` (both recorded in the golden file by
``--write``; here 1.0e-07 and 2.3e-04). RTOL sits between the two: at least a decade above the
drift, at most half the 1 % LR change.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.full_system  # a training run end to end (one rank, in this process, ~20 s)

GOLDEN = Path(__file__).parents[1] / "data" / "golden_loss_bert_tiny.json"
STEPS = 20
RTOL = 1e-5
RUN = [
    "data.source=synthetic",
    "data.eval_samples=8",
    "launch.env=single",
    "train.global_batch=8",
    f"train.max_steps={STEPS}",
    f"train.eval_every={STEPS}",
    "train.target=null",
    "train.deterministic=true",
    "train.progress=false",
    "train.metrics=[]",
    "checkpoint.dir=null",
    "checkpoint.every_steps=0",
    "optim.warmup_steps=5",
    "optim.total_steps=100",
    "comm.algorithm=flat",
]


def losses(*overrides: str, threads: int = 1) -> list[float]:
    """The per-step training losses of the golden run (plus ``overrides``)."""
    import torch

    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer
    from scaleout.world import init

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("bert_tiny_cpu", [*RUN, f"train.output_dir={out}", *overrides])
        world = init(cfg)
        try:
            trainer = Trainer(cfg, world)
            result = trainer.train()
        finally:
            world.close()
    assert result.status == "max_steps" and result.steps == STEPS
    return [float(x) for x in trainer.losses]


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_tiny_config_matches_its_golden_losses() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert golden["run"] == RUN, (
        "the golden run's settings changed: regenerate "
        "(python tests/train/test_golden_loss.py --write)"
    )
    got = losses()
    assert len(got) == STEPS
    assert got == pytest.approx(golden["losses"], rel=RTOL), (
        f"max relative difference {_max_rel(got, golden['losses']):.2e} > {RTOL:g}: if the change "
        "is intended, "
        "regenerate with `python tests/train/test_golden_loss.py --write` and say why in the commit"
    )


def test_tolerance_sits_between_kernel_drift_and_a_real_change() -> None:
    """The recorded measurements justify RTOL: a decade above the thread-count drift, at most
    half a 1 % LR change."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["threads_drift"] * 10 <= RTOL <= golden["lr_1pct"] / 2, golden


def write() -> None:
    base = losses()
    assert losses() == base, "two runs of the golden config differ: it is not deterministic"
    drift = _max_rel(losses(threads=2), base)
    lr = _max_rel(losses("optim.lr=0.0202"), base)  # the config's 2e-2, 1 % higher
    GOLDEN.write_text(
        json.dumps({"run": RUN, "losses": base, "threads_drift": drift, "lr_1pct": lr}, indent=1)
        + "\n"
    )
    print(
        f"wrote {GOLDEN}: {len(base)} losses; 2-thread drift {drift:.2e}, 1 % LR change {lr:.2e}, "
        f"RTOL {RTOL:g}"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/train/test_golden_loss.py --write")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    write()
