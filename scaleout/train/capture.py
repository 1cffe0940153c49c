"""Step capture: ``torch.compile`` of the model and CUDA graphs of the whole training step.

**``model.compile=true``** compiles the *inner* model in place (``nn.Module.compile``) before
:class:`scaleout.parallel.DataParallel` wraps it, rather than ``torch.compile(DataParallel(...))``:

- DataParallel's reducer lives in post-accumulate-grad hooks on the parameters and an
  autograd-engine callback. Parameters are leaves *outside* the compiled graphs (AOTAutograd lifts
  them to inputs), so their ``AccumulateGrad`` nodes, and the hooks on them, still run in the eager
  autograd engine: the overlapped bucketed all-reduce keeps working unchanged, with no compiled
  autograd needed. What changes is granularity: each compiled graph's backward is one autograd node,
  so all gradients of one graph become ready together (buckets launch per graph, not per layer).
- Compiling the wrapper instead would make dynamo trace the reducer's Python (``_BackwardStart``
  carries the reducer object), which graph-breaks at best, and ``no_sync()``/``last_stats`` would
  hide behind ``OptimizedModule``; in place, ``state_dict`` keys and checkpoints are unchanged.
- The default BERT forward graph-breaks on CPU (the ``int(pos.max())`` range check and the boolean
  selections of masked positions and NSP rows, whose sizes depend on the data); each piece is still
  fused (FC + bias + GELU, LayerNorm + residual, softmax) by Inductor.
  ``model.bert.static_shapes=true``
  (the capture-safe forward, see ``scaleout/families/bert/model.py``) compiles as one graph with
  ``fullgraph=True`` (tested). ``scaleout bench compile`` measures what compiling buys.

**``model.cuda_graphs=true``** (CUDA only) captures the step with ``torch.cuda.graphs``: zero the
gradients, forward + backward of every micro-batch, the gradient all-reduce of the reducer's
buckets, and the optimizer when it can be captured. One graph per distinct input shape (a dict key
-> graph), as NVIDIA's MLPerf BERT keeps one graph per packed shape: packing makes shapes static, so
a run sees one or a few keys. Per key, the first ``warmup`` (>= 3, :data:`MIN_WARMUP`) steps run
eagerly on a side stream (lazy initialisation, cuBLAS workspaces, allocator warm-up, autograd's
stream bookkeeping: the recipe of the PyTorch CUDA-graphs docs, which warms up 3 iterations on a
side stream), the next step captures into static input buffers and replays; after that a step is
"copy the batch into the static buffers, replay". Every call is exactly one training step (warm-up
steps are real steps).

The capture runs in ``capture_error_mode="thread_local"``: in torch's default ``"global"`` mode any
capture-unsafe CUDA call from *any* thread of the process during the capture (the DataLoader's
pin-memory thread calls ``cudaHostAlloc`` and ``cudaEventQuery`` whenever ``data.num_workers > 0``
on CUDA) fails with ``cudaErrorStreamCaptureUnsupported``; the capture then falls back to eager and
the pin thread re-raises the error on its next batch, killing the run (pytorch/pytorch#175425).
Thread-local mode only forbids unsafe calls from the capturing thread, which is what the step
needs.

What is not captured, and why:

- The reducer's *overlapped* path (Python hooks, futures, a host read of the parameter usage) cannot
  be captured; the captured step runs backward under ``no_sync()`` and then all-reduces each bucket
  buffer with the run's algorithm (flat / hierarchical / torus2d), compression and pre-divide,
  issued synchronously from the capturing thread (``Reducer.reduce_now``; NCCL collectives are
  capturable since NCCL 2.9.6). Launch overhead, which graphs remove, is what dominates at the small
  per-GPU batches of max-scale runs.
- Mixed precision: autocast runs inside the graph with its weight-cast cache off (required in
  captured regions), and the fp16 loss scale is a device tensor the graph reads, so it can change
  between replays; unscaling runs eagerly after the replay.
- scaleout's replicated LAMB/LARS compute per-step scalars (learning rate, bias correction, global
  clip factor) on the host; a graph would freeze them at their capture-time values. With
  DataParallel the optimizer runs eagerly after the replay, which also keeps the trainer's NaN-skip
  agreement between gradients and update.

**The sharded LAMB's step is captured whole** (:func:`sharded_step`, ``optim.sharded=true``): its
bucket reduce-scatters are issued by backward's hooks inside the capture (overlapped with the rest
of backward, on the comm stream forked from the capture stream), then its device-only step
(``ShardedLAMB.use_graphs``: the step's scalars copied from a pinned buffer that
``StepGraphs.stage`` refills before each replay, the clip factor on the device, a non-finite
gradient blended away on the device) and the all-gathers, joined before the capture ends. The
trainer reads the skip with the step's agreement and counts the step (``ShardedLAMB.settle``).
fp16 is not captured with it (its loss scale is a host value).

**The step's agreement rides inside the graph** (both steps' ``arm``): the trainer writes its host
values (stop / notice / terminate flags, FLOPs, the last step's phase times, this step's
fingerprint) into a pinned buffer before every run of the step; the graph copies it up, puts the
loss beside it and starts its all-reduce before the last backward, and waits for it at its end
(a stream wait); the trainer reads the result after the replay, with the device flags of the
non-finite and unused checks, as the step's one host read.
- Anything that syncs with the host inside the step (``.item()``, boolean indexing with a
  data-dependent size) makes capture fail: the step then runs eagerly for the rest of the run and
  one warning says why. BERT's default forward has such syncs, so ``model.cuda_graphs=true`` selects
  its capture-safe forward (``model.bert.static_shapes``, unset = follow ``model.cuda_graphs``):
  fixed MLM and NSP slots gathered with index tensors, the loss weighted by validity, no range
  check, no varlen attention, so every shape is a function of the batch *shape* and one graph per
  packed shape holds. Setting ``model.bert.static_shapes=false`` explicitly with graphs on earns a
  warning (:func:`host_sync_reason`), and the capture then fails over to eager as above.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from scaleout.config.schema import Config
from scaleout.errors import UserError
from scaleout.log import print0
from scaleout.world import World

log = logging.getLogger("scaleout.train.capture")

# What a captured step calls with its loss before the last backward (the trainer's agreement):
# it issues device work and returns what to call at the end of the step (a wait inside the graph:
# a capture must join every stream it forked), or None.
Arm = Callable[[torch.Tensor], Callable[[], None] | None]

# Eager warm-up steps per input shape before its capture (the PyTorch CUDA-graphs recipe: 3 on a
# side stream), and the capture error mode that tolerates the input pipeline's threads.
MIN_WARMUP = 3
CAPTURE_ERROR_MODE = "thread_local"


# -- torch.compile
# -------------------------------------------------------------------------------------
def compile_model(
    module: torch.nn.Module, backend: str = "inductor", mode: str | None = None
) -> torch.nn.Module:
    """Compile ``module`` in place (parameters, hooks and ``state_dict`` keys unchanged) and
    return it."""
    module.compile(backend=backend, mode=mode)
    return module


# -- CUDA graphs
# ---------------------------------------------------------------------------------------
def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if hasattr(x, "inputs"):  # a MicroBatch
        return _tensors(x.inputs) + _tensors(x.target)
    return []


def shape_key(batch: Any) -> tuple[Any, ...]:
    """The graph key of a step's input: shapes and dtypes of every tensor, in a fixed order."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(batch))


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    if hasattr(x, "inputs"):
        return replace(x, inputs=_clone(x.inputs), target=_clone(x.target))
    return x


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    static_in: Any  # the buffers the graph reads
    # what the step function returned during capture (overwritten per replay)
    static_out: torch.Tensor
    replays: int = 0


class StepGraphs:
    """``step_fn(batch) -> loss tensor`` run as one CUDA graph per input shape (see module
    docstring).

    ``graphs(batch)`` returns the step's loss; the graphs are in ``graphs.graphs`` keyed by
    :func:`shape_key`. If a capture fails, the error is logged once and every later call runs
    ``step_fn`` eagerly (``graphs.disabled`` holds the reason)."""

    def __init__(
        self,
        step_fn: Callable[[Any], torch.Tensor],
        device: torch.device | str | None = None,
        warmup: int = MIN_WARMUP,
        stage: Callable[[], None] | None = None,
    ):
        if warmup < MIN_WARMUP:
            raise UserError(
                f"StepGraphs warmup={warmup}: expected >= {MIN_WARMUP} eager steps per shape "
                "before its capture (the CUDA-graphs recipe)"
            )
        # (a CUDA device without torch's CUDA runtime: tests/fakecuda.py's emulated GPU)
        if not torch.cuda.is_available() and (
            device is None or torch.device(device).type != "cuda"
        ):
            raise UserError(
                "StepGraphs needs CUDA (torch.cuda.is_available() is False); run the step eagerly"
            )
        self.step_fn = step_fn
        # host values a replay reads (pinned buffers the step copies from): written before each
        # replay; an eager or captured call of step_fn writes them itself
        self.stage = stage
        self.device = (
            torch.device(device)
            if device is not None
            else torch.device("cuda", torch.cuda.current_device())
        )
        self.warmup = warmup
        self._stream: Any = None  # the side stream of the warm-up steps (made on first use)
        self.graphs: dict[tuple[Any, ...], _Graph] = {}
        self.seen: dict[tuple[Any, ...], int] = {}
        self.disabled: str | None = None

    def __call__(self, batch: Any) -> torch.Tensor:
        if self.disabled:
            return self.step_fn(batch)
        key = shape_key(batch)
        entry = self.graphs.get(key)
        if entry is None:
            n = self.seen.get(key, 0)
            if n < self.warmup:
                self.seen[key] = n + 1
                return self._side_stream(batch)
            try:
                entry = self._capture(key, batch)
            except Exception as exc:  # noqa: BLE001 -- any capture failure means: run eagerly from now on
                self.disabled = (
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                )
                log.warning(
                    "model.cuda_graphs: capturing the step failed (%s); running it eagerly",
                    self.disabled,
                )
                torch.cuda.synchronize(self.device)
                return self.step_fn(batch)
        else:
            for dst, src in zip(_tensors(entry.static_in), _tensors(batch), strict=True):
                dst.copy_(src, non_blocking=True)
        if self.stage is not None:
            self.stage()
        entry.graph.replay()
        entry.replays += 1
        return entry.static_out

    def _side_stream(self, batch: Any) -> torch.Tensor:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        s = self._stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            out = self.step_fn(batch)
        torch.cuda.current_stream(self.device).wait_stream(s)
        return out

    def _capture(self, key: tuple[Any, ...], batch: Any) -> _Graph:
        static_in = _clone(batch)  # allocated outside the graph's pool: persists between replays
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        # thread_local: the prefetcher's pin-memory thread keeps running (module docstring)
        with torch.cuda.graph(g, capture_error_mode=CAPTURE_ERROR_MODE):
            out = self.step_fn(static_in)
        entry = _Graph(g, static_in, out)
        self.graphs[key] = entry
        return entry


def capturable_optimizer(optimizer: Any) -> bool:
    """True when every param group of ``optimizer`` keeps its per-step scalars on the device."""
    groups = getattr(optimizer, "param_groups", None) or []
    return bool(groups) and all(g.get("capturable", False) for g in groups)


def _micro_batches(
    model: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    mbs: list[Any],
    precision: Any,
    arm: Arm | None,
    no_sync: Callable[[], Any] | None = None,
) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Forward + backward of each micro-batch of a captured step (``precision``'s autocast without
    its weight cache, and its loss scale); ``no_sync``: the context of all but the last; ``arm``
    called with the step's loss before the last backward. Returns (the summed loss, what arm
    returned)."""
    if not mbs:
        raise ValueError("a captured step needs at least one micro-batch")
    total, done = None, None
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with (
                precision.autocast(cache=False)
                if precision is not None
                else contextlib.nullcontext()
            ):
                loss = loss_fn(model, mb) / len(mbs)
            total = loss.detach() if total is None else total + loss.detach()
            if arm is not None and last:
                done = arm(total)
            (precision.scale_loss(loss) if precision is not None else loss).backward()
    assert total is not None
    return total, done


def data_parallel_step(
    model: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Any = None,
    precision: Any = None,
    arm: Arm | None = None,
) -> Callable[[list[Any]], torch.Tensor]:
    """The capturable step of a :class:`scaleout.parallel.DataParallel` model: zero grads,
    forward + backward of every micro-batch under ``no_sync()`` (and ``precision``'s autocast
    without its weight cache, and its loss scale), then every bucket's all-reduce with the
    model's configured algorithm, compression and pre-divide (``reducer.reduce_now``: issued from
    this thread, so a capture records it), then ``optimizer.step()`` if an optimizer is given.
    ``arm`` (:data:`Arm`): called with the step's loss before the last backward. Returns the
    summed (averaged, unscaled) loss."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(mbs: list[Any]) -> torch.Tensor:
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        with model.no_sync():
            total, done = _micro_batches(model, loss_fn, mbs, precision, arm)
        model.reducer.reduce_now()
        if optimizer is not None:
            optimizer.step()
        if done is not None:
            done()
        return total

    return step


def host_sync_reason(model: Any) -> str | None:
    """Why ``model``'s forward cannot be captured (a known host sync), or None. Looks through
    wrappers (``DataParallel.module``, ``OptimizedModule._orig_mod``); today it knows BERT's
    dynamic heads."""
    inner = model
    for attr in ("module", "_orig_mod"):
        inner = getattr(inner, attr, inner)
    cfg = getattr(inner, "cfg", None)
    if (
        cfg is not None
        and hasattr(cfg, "unpad_mlm_head")
        and not getattr(cfg, "static_shapes", False)
    ):
        return (
            "the BERT forward has host syncs (masked-position selection, position range check); "
            "set "
            "model.bert.static_shapes=true or leave it unset"
        )
    return None


def sharded_step(
    model: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Any,
    precision: Any = None,
    arm: Arm | None = None,
) -> Callable[[list[Any]], torch.Tensor]:
    """The capturable step of the sharded LAMB (``optim.sharded``, after its ``use_graphs()``):
    forward + backward of every micro-batch (all but the last under ``optimizer.no_sync()``), the
    gradient reduce-scatters issued by its hooks as backward produces each bucket, then its
    device-only ``step()`` and the parameters' all-gathers. The gradients start as None, so the
    captured backward writes them rather than adding to the capture's. ``arm``
    (:data:`Arm`): called with the step's loss before the last backward (the trainer's
    agreement, whose all-reduce then runs during backward inside the graph). Returns the summed
    loss."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(mbs: list[Any]) -> torch.Tensor:
        for p in params:
            p.grad = None
        total, done = _micro_batches(model, loss_fn, mbs, precision, arm, optimizer.no_sync)
        optimizer.step()
        if done is not None:
            done()
        return total

    return step


def graphed_step(cfg: Config) -> tuple[bool, bool]:
    """What ``cfg``'s step is on CUDA, for whoever prices it (``scaleout simulate``): (captured:
    the step runs as CUDA graphs, overlapped: its gradient collectives run during backward).
    Captured when ``model.cuda_graphs`` is set (and, with the sharded LAMB, the precision is not
    fp16: its loss scale is a host value). The sharded LAMB's captured step issues its
    reduce-scatters from backward's hooks (:func:`sharded_step`), so it overlaps as its
    ``optim.overlap_comm`` says; DataParallel's captured step reduces after backward
    (:func:`data_parallel_step`), so it never overlaps."""
    sharded = cfg.optim.sharded
    captured = bool(cfg.model.cuda_graphs) and not (sharded and cfg.train.precision == "fp16")
    if sharded:
        return captured, bool(cfg.optim.overlap_comm)
    return captured, bool(cfg.comm.overlap) and not captured


def build_step_graphs(
    cfg: Config,
    world: World,
    model: torch.nn.Module,
    task: Any,
    optimizer: Any = None,
    arm: Arm | None = None,
) -> StepGraphs | None:
    """The trainer's StepGraphs for ``model.cuda_graphs=true``, or None (with one warning) where
    it cannot apply: not on CUDA, or the sharded LAMB under fp16 (its loss scale is a host
    value). DataParallel's step: the trainer's optimizer runs after the replay (its NaN-skip
    agreement sits between the averaged gradients and the update, and LAMB/LARS keep per-step
    scalars on the host: module docstring). The sharded LAMB's step is captured whole,
    optimizer included (``optimizer.use_graphs()``: its scalars staged before each replay, its
    skip a device flag the trainer reads with the agreement)."""
    if not cfg.model.cuda_graphs:
        return None
    dev = torch.device(world.device)
    if dev.type != "cuda":
        print0(
            f"warning: model.cuda_graphs=true needs CUDA, this run is on {dev.type}: the step runs "
            "eagerly",
            rank=world.rank,
        )
        return None
    sharded = cfg.optim.sharded
    if sharded and cfg.train.precision == "fp16":
        print0(
            "warning: model.cuda_graphs=true with optim.sharded=true needs train.precision bf16 "
            "or fp32 (fp16's loss scale is a host value): the step runs eagerly",
            rank=world.rank,
        )
        return None
    if not sharded and not hasattr(model, "reducer"):
        print0(
            "warning: model.cuda_graphs=true needs DataParallel's reducer: the step runs eagerly",
            rank=world.rank,
        )
        return None
    reason = host_sync_reason(model)
    if reason:
        print0(
            f"warning: model.cuda_graphs=true: {reason}; "
            "capture will fail and the step run eagerly",
            rank=world.rank,
        )
    if sharded:
        optimizer.use_graphs()
        step = sharded_step(model, task.loss, optimizer, precision=task.precision, arm=arm)
        return StepGraphs(step, dev, stage=optimizer.stage)
    step = data_parallel_step(model, task.loss, precision=task.precision, arm=arm)
    return StepGraphs(step, dev)
