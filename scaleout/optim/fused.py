"""One-pass LAMB and LARS kernels: each phase of the step streams its tensors once.

A chain of ``torch._foreach_*`` ops writes every intermediate array and reads it back: on a GPU,
where each op is a kernel streaming from device memory, the LAMB step moved ~100 bytes per fp32
parameter and LARS ~52, against 28 for torch's fused AdamW and 20 for its fused SGD (counted by
:mod:`scaleout.optim.bytecount`). These custom ops do each phase in one pass over its operands:

- ``scaleout::lamb_moments_(p, g, m, v, ...)``: updates m and v and returns the per-tensor squared
  norms [||w||^2; ||u/k||^2] of the weights and of the update direction (never written out):
  reads p, g, m, v, writes m, v (24 B per fp32 parameter);
- ``scaleout::lamb_apply_(p, m, v, scale, ...)``: recomputes u from m, v, w and applies
  ``w += scale_i u`` (the per-tensor trust ratio folded into ``scale``, a device vector: no host
  sync): reads p, m, v, writes p (16 B). LAMB in all: 40 B, 1.43x fused AdamW;
- ``scaleout::lars_apply_(p, g, b, scale, ...)``: ``b = momentum b + scale_i (g + wd w); w -= b`` in
  one pass: reads p, g, b, writes p, b (20 B); with the two norm reads LARS moves 28 B, 1.4x fused
  SGD.

Implementations. On CUDA each op runs its plain per-tensor arithmetic through ``torch.compile``
(inductor fuses each tensor's phase into one kernel: the moments, the direction and both squared
sums in one loop; checked on this machine's C++ backend by ``scaleout bench optim --compiled``);
should compiling fail, it warns once and runs the eager chain. Everywhere else (CPU, and the
emulated device of the tests) they run the eager foreach chain of scaleout/optim/lamb.py and
lars.py in cache-sized chunks (chunks.py), so there too each array leaves DRAM about once per
phase; the results are bit-identical to LAMB's and LARS's multi-tensor foreach paths. Who uses
them: LAMB and LARS with ``onepass=None`` on any non-CPU device (``onepass=True`` forces them).
The CUDA kernels round differently from the eager chain (fused multiply-adds, another summation
order): the gpu test in tests/optim/test_optim_bytes.py bounds the difference.
"""

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from scaleout.optim.base import scalars
from scaleout.optim.chunks import ChunkPlan, plan_chunks
from scaleout.optim.chunks import pieces as chunk_pieces
from scaleout.optim.lamb import LambCoeffs, direction, update_moments

Tensors = list[torch.Tensor]
Scalar = float | torch.Tensor  # a Python float, or a 0-d CPU tensor in the compiled kernels
# devices besides CUDA whose kernels run compiled: {"cpu"} makes the CPU run the code the GPU runs
# (scaleout bench optim --compiled); the CPU default is the cache-blocked foreach chain
COMPILE_DEVICES: set[str] = set()


@functools.lru_cache(maxsize=64)
def _plan(numels: tuple[int, ...], split: tuple[bool, ...], chunk: int, device: str) -> ChunkPlan:
    return plan_chunks(numels, chunk or None, split, device)


def plan_for(tensors: Tensors, chunk: int) -> ChunkPlan:
    """The chunk plan of ``tensors`` (``chunk`` elements per chunk, 0 = whole tensors), cached."""
    return _plan(
        tuple(t.numel() for t in tensors),
        tuple(t.is_contiguous() for t in tensors),
        chunk,
        str(tensors[0].device),
    )


def _coeffs(beta1: float, beta2: float, m_weight: float, v_weight: float, eps: float, wd: float):
    return LambCoeffs(beta1, beta2, m_weight, v_weight, eps, wd, 1.0, 0.0, True, None)


# -- the plain arithmetic that torch.compile fuses (CUDA) ---------------------------------------
def _lamb_moments_math(
    p: Tensors, g: Tensors, m: Tensors, v: Tensors, b1: Scalar, b2: Scalar, mw: Scalar, vw: Scalar,
    eps: Scalar, wd: Scalar,
) -> torch.Tensor:  # fmt: skip
    w2, u2 = [], []
    for pi, gi, mi, vi in zip(p, g, m, v, strict=True):
        gf, pf = gi.to(mi.dtype), pi.to(mi.dtype)
        m2 = mi * b1 + gf * mw
        v2 = vi * b2 + gf * gf * vw
        mi.copy_(m2)
        vi.copy_(v2)
        u = m2 / (v2.sqrt() + eps) + pf * wd
        w2.append(pf.square().sum())
        u2.append(u.square().sum())
    return torch.stack([torch.stack(w2), torch.stack(u2)])


def _lamb_apply_math(
    p: Tensors, m: Tensors, v: Tensors, scale: torch.Tensor | None, uniform: Scalar, eps: Scalar,
    wd: Scalar,
) -> None:  # fmt: skip
    for i, (pi, mi, vi) in enumerate(zip(p, m, v, strict=True)):
        pf = pi.to(mi.dtype)
        u = mi / (vi.sqrt() + eps) + pf * wd
        pi.copy_(pf + (uniform if scale is None else scale[i]) * u)


def _lars_apply_math(
    p: Tensors, g: Tensors, b: Tensors, scale: torch.Tensor | None, uniform: Scalar,
    momentum: Scalar, wd: Scalar,
) -> None:  # fmt: skip
    for i, (pi, gi, bi) in enumerate(zip(p, g, b, strict=True)):
        pf = pi.to(bi.dtype)
        s = uniform if scale is None else scale[i]
        b2 = bi * momentum + s * (gi.to(bi.dtype) + pf * wd)
        bi.copy_(b2)
        pi.copy_(pf - b2)


_FAILED: set[str] = set()  # functions whose compilation failed: run eagerly
_RAN: set[str] = set()  # functions that have run compiled


def _hp(*values: float) -> list[torch.Tensor]:
    """Per-step scalars as 0-d CPU float64 tensors: torch.compile specialises on Python floats (a
    recompile whenever the learning rate or a bias correction changes, i.e. every step), while a
    0-d CPU tensor is a kernel argument read on the host (no device copy, no sync)."""
    return [torch.tensor(v, dtype=torch.float64) for v in values]


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True, dynamic=False)


def run_compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` through torch.compile. If its first call fails (compiling happens there, before any
    input is written), a warning and ``fn`` eagerly from then on; once it has run compiled, errors
    propagate (a retry could apply a half-done update twice)."""
    name = fn.__name__
    if name in _FAILED:
        return fn(*args)
    if name in _RAN:
        return _compiled(fn)(*args)
    try:
        out = _compiled(fn)(*args)
    except Exception as e:  # noqa: BLE001 -- any compiler failure: run the same code eagerly
        _FAILED.add(name)
        warnings.warn(
            f"scaleout.optim.fused: torch.compile of {name} failed ({type(e).__name__}: {e}); "
            "running it eagerly (correct, but it moves more bytes)",
            stacklevel=2,
        )
        return fn(*args)
    _RAN.add(name)
    return out


# -- scaleout::lamb_moments_ ---------------------------------------------------------------------
@torch.library.custom_op("scaleout::lamb_moments_", mutates_args=("m", "v"))
def lamb_moments_(
    p: Tensors, g: Tensors, m: Tensors, v: Tensors, beta1: float, beta2: float,
    m_weight: float, v_weight: float, eps: float, wd: float, chunk: int,
) -> torch.Tensor:  # fmt: skip
    """m = b1 m + m_weight g, v = b2 v + v_weight g^2 (fp32), and the (2, n) fp32 squared norms
    [||w||^2; ||u||^2] with u = m / (sqrt(v) + eps) + wd w (lamb.py's folded direction), in chunks
    of ``chunk`` elements (0 = whole tensors)."""
    if "cpu" in COMPILE_DEVICES:
        return _lamb_moments_cuda(p, g, m, v, beta1, beta2, m_weight, v_weight, eps, wd, chunk)
    co = _coeffs(beta1, beta2, m_weight, v_weight, eps, wd)
    plan = plan_for(p, chunk)
    P, G, M, V = (chunk_pieces(t, plan) for t in (p, g, m, v))
    wn: list[torch.Tensor] = []
    un: list[torch.Tensor] = []
    for c in range(plan.num_chunks):
        update_moments(G[c], M[c], V[c], co)
        u = direction(P[c], M[c], V[c], co)
        wn.extend(torch._foreach_norm(P[c], 2, dtype=torch.float32))
        un.extend(torch._foreach_norm(u, 2, dtype=torch.float32))
    sq = torch.zeros(2, len(p), dtype=torch.float32, device=p[0].device)
    own = plan.owner[0] if plan.num_chunks == 1 else torch.cat(list(plan.owner))
    return sq.index_add_(1, own, torch.stack([torch.stack(wn), torch.stack(un)]).square_())


@lamb_moments_.register_kernel("cuda")
def _lamb_moments_cuda(
    p: Tensors, g: Tensors, m: Tensors, v: Tensors, beta1: float, beta2: float,
    m_weight: float, v_weight: float, eps: float, wd: float, chunk: int,
) -> torch.Tensor:  # fmt: skip
    hp = _hp(beta1, beta2, m_weight, v_weight, eps, wd)
    return run_compiled(_lamb_moments_math, p, g, m, v, *hp)


@lamb_moments_.register_fake
def _(p: Tensors, g: Tensors, m: Tensors, v: Tensors, *args: Any) -> torch.Tensor:
    return p[0].new_empty((2, len(p)), dtype=torch.float32)


# -- scaleout::lamb_apply_ -----------------------------------------------------------------------
@torch.library.custom_op("scaleout::lamb_apply_", mutates_args=("p",))
def lamb_apply_(
    p: Tensors, m: Tensors, v: Tensors, scale: torch.Tensor | None, uniform: float, eps: float,
    wd: float, chunk: int,
) -> None:  # fmt: skip
    """w += s_i u with u = m / (sqrt(v) + eps) + wd w recomputed (never stored), per tensor i, in
    chunks of ``chunk`` elements (0 = whole tensors); s = ``scale`` (one per tensor, on the
    device), or ``uniform`` for all when ``scale`` is None."""
    if "cpu" in COMPILE_DEVICES:
        return _lamb_apply_cuda(p, m, v, scale, uniform, eps, wd, chunk)
    co = _coeffs(0.0, 0.0, 0.0, 0.0, eps, wd)
    plan = plan_for(p, chunk)
    P, M, V = (chunk_pieces(t, plan) for t in (p, m, v))
    if scale is None:
        for c in range(plan.num_chunks):
            torch._foreach_add_(P[c], direction(P[c], M[c], V[c], co), alpha=uniform)
        return
    own = plan.owner[0] if plan.num_chunks == 1 else torch.cat(list(plan.owner))
    per_piece = scalars(scale[own])
    at = 0
    for c in range(plan.num_chunks):
        n = len(P[c])
        u = direction(P[c], M[c], V[c], co)
        s = per_piece[at : at + n]
        at += n
        if n == 1 and not isinstance(s[0], torch.Tensor):
            torch._foreach_add_(P[c], u, alpha=s[0])
        else:
            torch._foreach_mul_(u, s)
            torch._foreach_add_(P[c], u)


@lamb_apply_.register_kernel("cuda")
def _lamb_apply_cuda(
    p: Tensors, m: Tensors, v: Tensors, scale: torch.Tensor | None, uniform: float, eps: float,
    wd: float, chunk: int,
) -> None:  # fmt: skip
    run_compiled(_lamb_apply_math, p, m, v, scale, *_hp(uniform, eps, wd))


@lamb_apply_.register_fake
def _(*args: Any) -> None:
    return None


# -- scaleout::lars_apply_ -----------------------------------------------------------------------
@torch.library.custom_op("scaleout::lars_apply_", mutates_args=("p", "b"))
def lars_apply_(
    p: Tensors, g: Tensors, b: Tensors, scale: torch.Tensor | None, uniform: float,
    momentum: float, wd: float, chunk: int,
) -> None:  # fmt: skip
    """b = momentum b + s_i (g + wd w); w -= b, per tensor i (LARS with s = lr t), in chunks of
    ``chunk`` elements (0 = whole tensors); s = ``scale`` (one per tensor, on the device), or
    ``uniform`` for all when ``scale`` is None. The arithmetic is fp32 for bf16 tensors."""
    if "cpu" in COMPILE_DEVICES:
        return _lars_apply_cuda(p, g, b, scale, uniform, momentum, wd, chunk)
    plan = plan_for(p, chunk)
    P, G, B = (chunk_pieces(t, plan) for t in (p, g, b))
    if scale is None:
        for c in range(plan.num_chunks):
            torch._foreach_mul_(B[c], momentum)
            torch._foreach_add_(B[c], G[c], alpha=uniform)
            if wd:
                torch._foreach_add_(B[c], P[c], alpha=uniform * wd)
            torch._foreach_sub_(P[c], B[c])
        return
    wd_scale = scale * wd
    for c in range(plan.num_chunks):
        own = plan.owner[c]
        torch._foreach_mul_(B[c], momentum)
        # per-tensor scalars as 0-d tensors (addcmul broadcasts them): fp32 arithmetic for bf16
        torch._foreach_addcmul_(B[c], G[c], list(scale[own].unbind()))
        if wd:
            torch._foreach_addcmul_(B[c], P[c], list(wd_scale[own].unbind()))
        torch._foreach_sub_(P[c], B[c])


@lars_apply_.register_kernel("cuda")
def _lars_apply_cuda(
    p: Tensors, g: Tensors, b: Tensors, scale: torch.Tensor | None, uniform: float,
    momentum: float, wd: float, chunk: int,
) -> None:  # fmt: skip
    run_compiled(_lars_apply_math, p, g, b, scale, *_hp(uniform, momentum, wd))


@lars_apply_.register_fake
def _(*args: Any) -> None:
    return None
