"""Step capture (scaleout/train/capture.py): torch.compile of the inner model under DataParallel
gives the eager loss and all-reduced gradients on real gloo ranks; CUDA graphs fall back to eager
with one warning on CPU; on a GPU, a captured step (one graph per input shape) equals the eager
step.

The fast compile test uses dynamo + AOTAutograd with the ``aot_eager`` backend: that is the part
that meets DataParallel's hooks (the parameters become graph inputs, the backward one autograd
node), and it compiles the tiny BERT in ~10 s on 2 cores. Inductor (C++ code generation, ~80 s cold
for the same model here) is checked in the ``slow`` test. The GPU tests skip without CUDA.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from fakecuda import FakeGraphs

from tests.distutil import run_dist

TINY = dict(
    vocab_size=64, hidden=16, layers=1, heads=2, intermediate=32, max_position=32, dropout=0.0
)


def _batch(seed: int, rows: int = 4, seq_len: int = 32) -> dict[str, torch.Tensor]:
    from scaleout.families.bert.data.bert_batch import (
        build_batch,
        padded_packs,
        synthetic_sequences,
    )

    rng = np.random.default_rng(seed)
    seqs = synthetic_sequences(rng.integers(12, seq_len + 1, rows), TINY["vocab_size"], seed=seed)
    return build_batch(seqs, padded_packs(rows), seq_len, 6, 1)


def _compile_vs_eager(world, backend: str) -> dict:
    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.model import BertForPreTraining
    from scaleout.parallel import DataParallel
    from scaleout.train.capture import compile_model

    torch.manual_seed(0)
    eager = BertForPreTraining(BertConfig(**TINY)).train()
    compiled = copy.deepcopy(eager)
    keys = list(eager.state_dict())
    compile_model(compiled, backend=backend)
    out = {"same_keys": list(compiled.state_dict()) == keys}
    dps = {
        "eager": DataParallel(eager, world, bucket_mb=0.01),
        "compiled": DataParallel(compiled, world, bucket_mb=0.01),
    }
    batch = _batch(seed=world.rank)  # different data per rank: the all-reduce matters
    for name, dp in dps.items():
        losses = []
        for _ in range(2):  # the second step runs on rebuilt buckets
            for p in dp.parameters():
                p.grad = None
            loss = dp(batch).loss
            loss.backward()
            losses.append(float(loss))
        out[name] = {
            "loss": losses,
            "grads": [p.grad.clone() for p in dp.module.parameters()],
            "buckets": dp.last_stats["buckets"],
        }
    return out


@pytest.mark.multi_process
def test_compiled_model_under_data_parallel_matches_eager() -> None:
    """2 ranks: the compiled model's loss and averaged gradients equal eager within fp32
    tolerance, and the reducer still all-reduces (gradients equal on both ranks though their
    batches differ)."""
    r = run_dist(_compile_vs_eager, nnodes=1, nproc_per_node=2, args=("aot_eager",), timeout=300)
    for rank in r:
        assert rank["same_keys"]
        assert (
            rank["eager"]["buckets"] > 1 and rank["compiled"]["buckets"] == rank["eager"]["buckets"]
        )
        np.testing.assert_allclose(
            rank["compiled"]["loss"], rank["eager"]["loss"], rtol=1e-5, atol=1e-6
        )
        for a, b in zip(rank["compiled"]["grads"], rank["eager"]["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert r[0]["eager"]["loss"] != r[1]["eager"]["loss"]  # different batches per rank ...
    for a, b in zip(r[0]["compiled"]["grads"], r[1]["compiled"]["grads"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # ... yet identical averaged gradients


@pytest.mark.extended  # minutes on 2 cores: python3 -m pytest -m extended (docs/testing.md)
@pytest.mark.multi_process
@pytest.mark.slow
def test_inductor_compiled_tiny_bert_matches_eager() -> None:
    """The real Inductor backend (C++ kernels on CPU), one process: ~40-80 s cold compile on 2
    shared cores, hence ``slow`` (the hook interplay is covered by the aot_eager test above)."""
    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.model import BertForPreTraining
    from scaleout.train.capture import compile_model

    torch.manual_seed(0)
    eager = BertForPreTraining(BertConfig(**TINY)).train()
    compiled = compile_model(copy.deepcopy(eager))
    batch = _batch(seed=0)
    losses = []
    for m in (eager, compiled):
        loss = m(batch).loss
        loss.backward()
        losses.append(float(loss))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.unit
def test_cuda_graphs_on_cpu_warn_and_run_eagerly(capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from scaleout.config import load_config
    from scaleout.errors import UserError
    from scaleout.train.capture import StepGraphs, build_step_graphs

    cfg = load_config(None, ["model.cuda_graphs=true"])
    world = SimpleNamespace(device=torch.device("cpu"), rank=0)  # only what build_step_graphs reads
    assert build_step_graphs(cfg, world, torch.nn.Linear(2, 2), None) is None
    assert (
        "model.cuda_graphs=true needs CUDA, this run is on cpu: the step runs eagerly"
        in capsys.readouterr().out
    )
    assert build_step_graphs(load_config(None, []), world, None, None) is None  # off: nothing said
    assert capsys.readouterr().out == ""
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="StepGraphs needs CUDA"):
            StepGraphs(lambda b: b)


def _bert_loss(model, batch):
    return model(batch).loss


@pytest.mark.multi_process
def test_static_shape_bert_step_compiles_as_one_graph() -> None:
    """No host syncs, static shapes: the BERT forward + loss with ``model.bert.static_shapes``
    compiles with ``fullgraph=True, dynamic=False`` (any graph break, ``.item()`` or
    data-dependent shape would raise), and AOTAutograd traces its backward too; loss and
    gradients equal the eager default forward. The default forward cannot be compiled that way
    (``int(pos.max())``, ``labels[valid]``). ``aot_eager``: graph breaks are the point, not
    Inductor's kernels (~10 s here)."""
    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.model import BertForPreTraining

    torch.manual_seed(0)
    dynamic = BertForPreTraining(BertConfig(**TINY)).train()
    static = BertForPreTraining(BertConfig(**TINY, static_shapes=True)).train()
    static.load_state_dict(dynamic.state_dict())
    batch = _batch(seed=0)
    torch._dynamo.reset()
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        torch.compile(_bert_loss, fullgraph=True, dynamic=False, backend="eager")(dynamic, batch)
    torch._dynamo.reset()
    compiled = torch.compile(_bert_loss, fullgraph=True, dynamic=False, backend="aot_eager")
    loss_c = compiled(static, batch)
    loss_c.backward()
    loss_e = _bert_loss(dynamic, batch)
    loss_e.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(loss_c.detach(), loss_e.detach(), rtol=1e-6, atol=1e-7)
    for (name, a), b in zip(static.named_parameters(), dynamic.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.unit
def test_cuda_graphs_select_the_capture_safe_bert_forward() -> None:
    """model.cuda_graphs=true builds BERT with static shapes unless model.bert.static_shapes says
    otherwise; StepGraphs' pre-flight check names the host syncs of the dynamic forward."""
    from types import SimpleNamespace

    from scaleout.config import load_config
    from scaleout.train.capture import host_sync_reason
    from scaleout.train.task import build_task

    world = SimpleNamespace(
        rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), barrier=lambda: None
    )
    small = [
        "data.source=synthetic",
        "data.max_seq_len=32",
        "data.max_predictions=5",
        "model.bert.vocab_size=64",
        "model.bert.hidden=16",
        "model.bert.layers=1",
        "model.bert.heads=2",
        "model.bert.intermediate=32",
        "model.bert.max_position=32",
        "data.eval_samples=8",
        "train.global_batch=8",
    ]
    picked = {}
    for extra in (
        [],
        ["model.cuda_graphs=true"],
        ["model.cuda_graphs=true", "model.bert.static_shapes=false"],
        ["model.bert.static_shapes=true"],
    ):
        task = build_task(load_config(None, small + extra), world)
        picked[" ".join(extra)] = (task.model.cfg.static_shapes, host_sync_reason(task.model))
    assert [v[0] for v in picked.values()] == [False, True, False, True], picked
    assert "host syncs" in picked["model.cuda_graphs=true model.bert.static_shapes=false"][1]
    assert picked["model.cuda_graphs=true"][1] is None
    assert host_sync_reason(torch.nn.Linear(2, 2)) is None


@pytest.mark.unit
def test_shape_key_separates_shapes_and_dtypes() -> None:
    from scaleout.data.batches import MicroBatch
    from scaleout.train.capture import shape_key

    a = [MicroBatch(_batch(0, rows=4), None, 4, 0)]
    assert shape_key(a) == shape_key(
        [MicroBatch(_batch(1, rows=4), None, 4, 0)]
    )  # values do not matter
    assert shape_key(a) != shape_key([MicroBatch(_batch(0, rows=2), None, 2, 0)])
    x = torch.zeros(2, 3)
    assert shape_key([MicroBatch(x, x.long(), 2, 0)]) != shape_key([MicroBatch(x, x.int(), 2, 0)])


@pytest.mark.unit
def test_capture_is_thread_local_after_three_side_stream_warmups() -> None:
    """A mock of torch.cuda's graph API (tests/fakecuda.FakeGraphs: no GPU can exist here) records
    how StepGraphs captures: torch's default ``capture_error_mode="global"`` lets the DataLoader's
    pin-memory thread kill the run, so the capture must say ``"thread_local"``; and at least 3
    eager warm-up steps run on a side stream before it (the CUDA-graphs recipe). Before: global
    mode after 1 warm-up."""
    from scaleout.errors import UserError
    from scaleout.train.capture import StepGraphs

    calls = []
    with FakeGraphs() as fg:

        def step(batch: torch.Tensor) -> torch.Tensor:
            calls.append((fg.capturing, fg.current))
            return batch.sum()

        graphs = StepGraphs(step, "cuda")
        losses = [float(graphs(torch.full((4,), float(i)))) for i in range(6)]
    assert [c["capture_error_mode"] for c in fg.captures] == ["thread_local"]
    warm = [stream for capturing, stream in calls if not capturing]
    assert len(warm) >= 3 and all(s is not fg.default for s in warm), calls
    assert len(calls) == len(warm) + 1 and calls[-1][0], calls  # then one capture, then replays
    entry = graphs.graphs[next(iter(graphs.graphs))]
    assert graphs.disabled is None and entry.graph.replays == 6 - len(warm)
    assert losses[: len(warm)] == [4.0 * i for i in range(len(warm))]
    with pytest.raises(UserError, match="warmup=1: expected >= 3"):
        StepGraphs(step, "cuda", warmup=1)


class _TinyDP(torch.nn.Module):
    """What build_step_graphs reads of a DataParallel: parameters, no_sync() and a reducer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.reducer = SimpleNamespace(reduce_now=lambda: None)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.unit
def test_trainer_graphs_with_input_workers_capture_thread_local() -> None:
    """The trainer's StepGraphs (build_step_graphs) for a run with prefetch workers
    (data.num_workers=2, the case where a pin-memory thread runs during the capture): thread-local
    capture after >= 3 warm-ups. torch.cuda's graph API is mocked (tests/fakecuda.FakeGraphs:
    no GPU can exist here); tests/train/test_capture.py's GPU test runs the real thing with
    workers."""
    from scaleout.config import load_config
    from scaleout.data.batches import MicroBatch
    from scaleout.train.capture import build_step_graphs

    cfg = load_config(None, ["model.cuda_graphs=true", "data.num_workers=2"])
    world = SimpleNamespace(device=torch.device("cuda", 0), rank=0)
    task = SimpleNamespace(loss=lambda m, mb: m(mb.inputs).sum(), precision=None)
    with FakeGraphs() as fg:
        graphs = build_step_graphs(cfg, world, _TinyDP(), task)
        assert graphs is not None and graphs.warmup >= 3
        for _ in range(graphs.warmup + 2):
            graphs([MicroBatch(torch.ones(2, 4), None, 2, 0)])
    assert [c["capture_error_mode"] for c in fg.captures] == ["thread_local"]
    assert graphs.disabled is None and len(graphs.graphs) == 1


def _train_with_workers_and_graphs(world: Any, out: str) -> dict[str, Any]:
    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer

    cfg = load_config(
        "bert_tiny_cpu",
        [
            "model.cuda_graphs=true",
            "data.num_workers=2",
            "train.global_batch=8",
            "data.eval_samples=16",
            "optim.warmup_steps=1",
            "optim.total_steps=12",
            "train.max_steps=8",
            "train.eval_every=8",
            "train.progress=false",
            f"train.output_dir={out}/out",
            "checkpoint.dir=null",
            "checkpoint.every_steps=0",
        ],
    )
    trainer = Trainer(cfg, world)
    assert trainer.prefetcher is not None and trainer.prefetcher.pin
    status = trainer.train().status
    graphs = trainer.graphs
    return {
        "status": status,
        "disabled": graphs.disabled if graphs else "no graphs",
        "replays": sum(e.replays for e in graphs.graphs.values()) if graphs else 0,
        "losses": trainer.losses,
    }


@pytest.mark.full_system
@pytest.mark.gpu(reason="CUDA graphs with the DataLoader's pin-memory thread")
def test_captured_training_with_prefetch_workers(tmp_path) -> None:
    """The real trainer on one GPU: model.cuda_graphs=true with data.num_workers=2 (pin-memory
    thread running during the capture). The capture succeeds (no fallback to eager), the graph
    replays the steps after the warm-ups, and the run ends normally with finite losses. Global
    capture mode failed here (cudaErrorStreamCaptureUnsupported, then the pin thread killed the
    run). A process of its own: the input workers are its children, which a pooled (daemonic)
    rank of run_dist cannot have."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(root)!r}, {str(root / 'tests')!r}]\n"
        "import scaleout\n"
        "from test_capture import _train_with_workers_and_graphs\n"
        "world = scaleout.init()\n"
        f"r = _train_with_workers_and_graphs(world, {str(tmp_path)!r})\n"
        "world.close()\n"
        "print('RESULT', json.dumps(r))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["status"] == "max_steps" and r["disabled"] is None, r
    assert r["replays"] >= 8 - 3 - 1, r  # 8 steps, >= 3 warm-ups, one shape (packed rows)
    assert all(loss is not None and np.isfinite(loss) for loss in r["losses"]), r


# -- GPU
# ------------------------------------------------------------------------------------------------


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


@pytest.mark.unit
@pytest.mark.gpu(reason="CUDA graphs")
def test_captured_whole_step_equals_eager_step() -> None:
    """Forward + backward + capturable AdamW in one graph per shape (two shapes, alternating)
    gives the same losses and weights as the same steps run eagerly."""
    from scaleout.train.capture import StepGraphs, capturable_optimizer

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = _mlp().to(dev)
    cap = copy.deepcopy(ref)
    opts = {
        m: torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2, device=dev), capturable=True)
        for m in (ref, cap)
    }
    assert capturable_optimizer(opts[cap])

    def step_fn(model):
        def step(batch):
            x, y = batch
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opts[model].step()
            return loss.detach()

        return step

    graphs = StepGraphs(step_fn(cap), dev)
    eager = step_fn(ref)
    g = torch.Generator(device=dev).manual_seed(1)
    for i in range(12):
        rows = 16 if i % 2 == 0 else 24
        batch = (
            torch.randn(rows, 8, device=dev, generator=g),
            torch.randn(rows, 4, device=dev, generator=g),
        )
        torch.testing.assert_close(graphs(batch).clone(), eager(batch), rtol=1e-5, atol=1e-6)
    assert graphs.disabled is None and len(graphs.graphs) == 2
    assert all(e.replays >= 2 for e in graphs.graphs.values())
    for a, b in zip(cap.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _dp_graph_vs_eager(world) -> dict:
    from scaleout.data.batches import MicroBatch
    from scaleout.parallel import DataParallel
    from scaleout.train.capture import StepGraphs, data_parallel_step

    torch.manual_seed(0)
    a = _mlp().to(world.device)
    b = copy.deepcopy(a)
    dp_eager, dp_cap = (
        DataParallel(a, world, bucket_mb=0.001),
        DataParallel(b, world, bucket_mb=0.001),
    )
    loss_fn = lambda m, mb: torch.nn.functional.cross_entropy(m(mb.inputs), mb.target)  # noqa: E731
    graphs = StepGraphs(data_parallel_step(dp_cap, loss_fn), world.device)
    g = torch.Generator(device=world.device).manual_seed(world.rank)
    same = []
    for _ in range(4):
        mbs = [
            MicroBatch(
                torch.randn(16, 8, device=world.device, generator=g),
                torch.randint(0, 4, (16,), device=world.device, generator=g),
                16,
                0,
            )
            for _ in range(2)
        ]
        loss_c = float(graphs(mbs))
        for p in a.parameters():
            p.grad = None
        with dp_eager.no_sync():
            (first := loss_fn(dp_eager, mbs[0]).div(2)).backward()
        (second := loss_fn(dp_eager, mbs[1]).div(2)).backward()
        same.append(
            abs(loss_c - float(first + second)) < 1e-4
            and all(
                torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-6)
                for x, y in zip(a.parameters(), b.parameters(), strict=True)
            )
        )
    return {"same": same, "disabled": graphs.disabled, "graphs": len(graphs.graphs)}


@pytest.mark.unit
@pytest.mark.gpu(reason="CUDA graphs")
def test_captured_static_shape_bert_step_equals_eager() -> None:
    """BERT with ``static_shapes`` captures (no fallback to eager), two packed-batch shapes, and
    each replayed step's loss and gradients equal the eager default forward on the same batch."""
    from scaleout.families.bert.config import BertConfig
    from scaleout.families.bert.model import BertForPreTraining
    from scaleout.train.capture import StepGraphs

    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = BertForPreTraining(BertConfig(**TINY)).to(dev).train()
    cap = BertForPreTraining(BertConfig(**TINY, static_shapes=True)).to(dev).train()
    cap.load_state_dict(ref.state_dict())

    def step(model):
        def run(batch):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            loss = model(batch).loss
            loss.backward()
            return loss.detach()

        return run

    graphs, eager = StepGraphs(step(cap), dev), step(ref)
    for i in range(10):
        batch = {k: v.to(dev) for k, v in _batch(seed=i, rows=4 if i % 2 else 2).items()}
        torch.testing.assert_close(graphs(batch).clone(), eager(batch), rtol=1e-5, atol=1e-6)
        for a, b in zip(cap.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert graphs.disabled is None and len(graphs.graphs) == 2, graphs.disabled


@pytest.mark.multi_process
@pytest.mark.gpu(reason="CUDA graphs")
def test_data_parallel_step_graph_matches_reducer() -> None:
    """The captured DataParallel step (no_sync backward + bucket all-reduce) gives the reducer's
    averaged gradients over 2 micro-batches. One rank (NCCL all-reduce in a graph needs one GPU
    per rank)."""
    n = torch.cuda.device_count()
    r = run_dist(_dp_graph_vs_eager, nnodes=1, nproc_per_node=min(n, 2), timeout=300)
    for rank in r:
        assert rank["disabled"] is None and rank["graphs"] == 1, rank
        assert all(rank["same"]), rank
