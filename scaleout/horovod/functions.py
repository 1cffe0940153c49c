"""Horovod's helpers on top of the collectives: broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object (``horovod.torch.functions``)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch

from scaleout.horovod import basics
from scaleout.horovod.basics import check_process_set, global_process_set
from scaleout.horovod.errors import HorovodValueError
from scaleout.horovod.movement import _allgather_async, broadcast_, broadcast_async_
from scaleout.horovod.ops import synchronize
from scaleout.horovod.optimizer import is_distributed


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Every rank gets root's values, in place: ``model.state_dict()`` (sorted by name, as Horovod
    does), ``model.named_parameters()``, or a list of tensors / (name, tensor) pairs. The broadcasts
    are queued together, so the engine fuses them into a few messages."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise HorovodValueError(
            f"broadcast_parameters: invalid params of type {type(params).__name__}"
        )
    handles = []
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise HorovodValueError(
                f"broadcast_parameters: {name!r} is a {type(value).__name__}, expected a tensor"
            )
        handles.append(broadcast_async_(value, root_rank, name))
    for h in handles:
        synchronize(h)


class _Spec:
    """Placeholder for a state tensor in the broadcast skeleton of an optimizer state."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape, self.on_cpu = t.dtype, tuple(t.shape), t.device.type == "cpu"


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every trainable parameter that has none yet: torch optimizers create a
    parameter's state lazily, at its first step with a gradient, so before the first step (or for a
    parameter that has had no gradient so far) the ranks' state keys differ from the root's.

    A fresh optimizer (no state at all) is initialised exactly as Horovod does it
    (horovod/torch/functions.py, broadcast_optimizer_state): every trainable parameter gets a zero
    gradient, replacing any it had, and the optimizer steps once. What that step leaves stays:
    parameters moved where the update is not zero at a zero gradient (weight decay, AdamW's
    decoupled decay) and zero gradients, so a Horovod script behaves here as under Horovod.

    An optimizer that has state for some parameters only is where this goes beyond Horovod (which
    then creates nothing and broadcasts by position, mismatching keys): the zero-gradient step runs
    on the parameters without state only (the others get no gradient for it, which torch optimizers
    skip), and their values and every gradient are put back, so parameters and gradients end as
    Horovod leaves them there: untouched. A DistributedOptimizer steps the wrapped class directly
    (its own step would all-reduce, and only this rank runs this). L-BFGS (a closure-driven step)
    and optimizers without per-parameter state are left as they are."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = [p for p in params if not optimizer.state.get(p)]
    if not missing:
        return
    fresh = len(missing) == len(params)
    need = {id(p) for p in missing}
    grads = [p.grad for p in params]
    values = [] if fresh else [p.detach().clone() for p in missing]
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in need else None
    try:
        if is_distributed(optimizer):
            super(type(optimizer), optimizer).step()
        else:
            optimizer.step()
    finally:
        if not fresh:
            with torch.no_grad():
                for p, v in zip(missing, values, strict=True):
                    p.copy_(v)
            for p, g in zip(params, grads, strict=True):
                p.grad = g


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None
) -> None:
    """Every rank loads root's optimizer state (state tensors and every param-group option, types
    kept).

    First every rank creates the state its trainable parameters lack (:func:`_initialise_state`:
    Horovod's zero-gradient step, which on a fresh optimizer leaves zero gradients and the step's
    weight decay as Horovod does), so a fresh optimizer or a parameter that has had no gradient yet
    gets state on every rank, the root included. Then root's
    ``state_dict()`` structure is broadcast as an object (tensors replaced by shape/dtype), its
    tensors as in-place broadcasts, and the other ranks ``load_state_dict`` it: every rank ends with
    root's state, the same keys and values, even where the ranks' keys differed before (Horovod
    would broadcast by position there and mismatch)."""
    _initialise_state(optimizer)
    sd = optimizer.state_dict()
    is_root = basics.rank() == root_rank
    skeleton = None
    if is_root:
        skeleton = {
            "param_groups": sd["param_groups"],
            "state": {
                pid: {k: _Spec(v) if torch.is_tensor(v) else v for k, v in st.items()}
                for pid, st in sd["state"].items()
            },
        }
    skeleton = broadcast_object(skeleton, root_rank, name="optimizer_state")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[Any, dict[str, Any]] = {}
    handles = []
    for pid, st in sorted(skeleton["state"].items(), key=lambda kv: str(kv[0])):
        state[pid] = {}
        for k, v in sorted(st.items(), key=lambda kv: str(kv[0])):
            if isinstance(v, _Spec):
                if is_root:
                    t = sd["state"][pid][k]
                else:
                    device = "cpu" if v.on_cpu or not isinstance(pid, int) else params[pid].device
                    t = torch.empty(v.shape, dtype=v.dtype, device=device)
                handles.append(broadcast_async_(t, root_rank, name=f"optimizer_state.{pid}.{k}"))
                v = t
            state[pid][k] = v
    for h in handles:
        synchronize(h)
    if not is_root:
        optimizer.load_state_dict({"state": state, "param_groups": skeleton["param_groups"]})


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """Root's picklable ``obj`` on every rank (its length, then its bytes)."""
    check_process_set(process_set)
    if basics.rank() == root_rank:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, f"{name}.sz" if name else None)
    if basics.rank() != root_rank:
        data = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name}.t" if name else None)
    return obj if basics.rank() == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (one variable-length byte allgather)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    handle = _allgather_async([data], name, False, "allgather_object")
    gathered = synchronize(handle).numpy().tobytes()
    out, pos = [], 0
    for n in handle.extra["rows"][0]:
        out.append(pickle.loads(gathered[pos : pos + n]))
        pos += n
    return out
