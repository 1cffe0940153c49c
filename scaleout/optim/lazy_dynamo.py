"""Keep ``torch._dynamo`` out of a rank that never compiles: ~2.5 s of CPU at every start.

torch marks four methods of every ``torch.optim.Optimizer`` (``add_param_group``, ``zero_grad``,
``state_dict``, ``load_state_dict``) with ``torch._disable_dynamo``, so that a compiled region
never traces into them. That decorator imports ``torch._dynamo`` on the method's first call, and
``torch._dynamo`` pulls in most of the compiler stack: building any optimizer cost each rank
2.5-2.7 s of CPU (measured on an AVX2 EPYC with torch 2.13; ``scaleout train``'s untimed start
named it "communicators": 2.68 of 2.69 s on one rank, 4.9 s on 2 x 2 ranks sharing two cores),
although LAMB, LARS and the sharded LAMB never run under dynamo unless a run asks for
``model.compile``.

Nothing can be tracing a call while ``torch._dynamo`` has not been imported, so the method needs
no guard then; once it is imported (a compile, the one-pass optimizer's compile, torch's own
optimizers' ``step``), the guard is torch's own ``torch._dynamo.disable``, as before. The
decorator's lazy cache (its ``__dynamo_disable`` attribute, torch/_compile.py) is where the choice
goes: a torch whose decorator no longer reads it just imports dynamo as it always did.

torch's *own* optimizers (AdamW, SGD) import dynamo in their first ``step()`` anyway
(``torch.optim.optimizer._use_grad_for_differentiable``): after MLPerf's ``run_start``, in the
clock. :func:`import_before_the_clock` pays it while the optimizer is built instead, as the
``torch.optim`` path always paid it at construction.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# the torch.optim.Optimizer methods under torch._disable_dynamo (torch/optim/optimizer.py)
GUARDED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_CACHE = "__dynamo_disable"  # torch._compile._disable_dynamo's per-function cache


def _deferred(raw: Callable[..., Any]) -> Callable[..., Any]:
    disabled: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing can be tracing this call
            return raw(*args, **kwargs)
        if not disabled:
            import torch._dynamo  # deferred: importing it is the cost this module avoids

            disabled.append(torch._dynamo.disable(raw, recursive=True, wrapping=False))
        return disabled[0](*args, **kwargs)

    call.scaleout_deferred = True  # type: ignore[attr-defined]
    return call


def defer_dynamo_import() -> list[str]:
    """Install the deferred guard on :data:`GUARDED` (idempotent); returns the methods it holds."""
    done = []
    for name in GUARDED:
        raw = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
        if raw is None:  # not decorated in this torch: nothing imports dynamo there
            continue
        current = getattr(raw, _CACHE, None)
        if current is None:
            setattr(raw, _CACHE, _deferred(raw))
        elif not getattr(current, "scaleout_deferred", False):
            continue  # dynamo was imported first and torch cached its own guard: keep it
        done.append(name)
    return done


def import_before_the_clock(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` (one of torch's own, whose first ``step()`` imports ``torch._dynamo``), with
    dynamo imported now, at build time, before ``run_start``: not in the first timed step."""
    import torch._dynamo  # deferred: torch's step would import it in the clock  # noqa: F401

    return optimizer
