"""Compile the one-pass LAMB/LARS kernels before the clock starts.

On CUDA the one-pass ops (scaleout/optim/fused.py) go through ``torch.compile`` the first time they
run: several cold inductor compiles over every tensor of a param group, on every rank. Left to the
first optimizer step, that happens after MLPerf's ``run_start``, inside the timed region of a run
that lasts a few minutes. MLPerf allows compilation before ``run_start``, so the trainer calls
:func:`warm_up` first: one step of a throwaway copy of the optimizer (its parameters and state
copied, zero gradients) compiles exactly the kernels the real steps will run, with the same
signatures (the shapes, dtypes and per-group arguments of ``torch.compile(dynamic=False)``), and
the first real step finds them compiled. The run's parameters and optimizer state are not touched.

The copy holds one more set of parameters, gradients and state while it runs (BERT-large: ~5.4 GB
of device memory, freed before ``run_start``).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from scaleout.optim import fused


def compiles(optimizer: Any) -> bool:
    """Whether ``optimizer``'s steps run compiled one-pass kernels (LAMB or LARS with the one-pass
    path on a compiled device: CUDA, or a device in ``fused.COMPILE_DEVICES``)."""
    params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]]
    if not params or not hasattr(optimizer, "onepass"):
        return False
    device = params[0].device.type
    use = getattr(optimizer, "_use_onepass", None)
    onepass = use(params) if callable(use) else optimizer.onepass
    if onepass is None:
        onepass = device != "cpu"
    return bool(onepass) and (device == "cuda" or device in fused.COMPILE_DEVICES)


@torch.no_grad()
def warm_up(optimizer: Any) -> float | None:
    """Run one step of a throwaway copy of ``optimizer`` with zero gradients, so that its compiled
    kernels exist before the first real step. Returns its seconds, or None when ``optimizer``
    compiles nothing."""
    if not compiles(optimizer):
        return None
    t0 = time.perf_counter()
    scratch = _throwaway(optimizer)
    for group in scratch.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    type(optimizer).step(scratch)  # the class's: a scheduler may have wrapped the instance's
    del scratch
    return time.perf_counter() - t0


def _throwaway(optimizer: Any) -> Any:
    """A copy of ``optimizer`` whose parameters, gradients and state are copies (one memo, so the
    state stays keyed by the copied parameters), its settings shared, its tensor caches (scratch
    buffers, made again on use) left out. Not ``copy.deepcopy``: torch's Optimizer pickles only
    its defaults, state and groups, and would drop the settings of LAMB and LARS."""
    memo: dict[int, Any] = {}
    scratch = object.__new__(type(optimizer))
    scratch.__dict__.update(
        {k: v for k, v in optimizer.__dict__.items() if not isinstance(v, torch.Tensor)}
    )
    scratch.param_groups = copy.deepcopy(optimizer.param_groups, memo)
    scratch.state = copy.deepcopy(optimizer.state, memo)
    return scratch
