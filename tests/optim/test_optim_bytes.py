"""Bytes per parameter of the LAMB and LARS steps (scaleout/optim/bytecount.py) against torch's
fused AdamW and SGD, and the one-pass kernels (scaleout/optim/fused.py) against the foreach chains.
"""

from __future__ import annotations

import pytest
import torch

from scaleout.optim import LAMB, LARS
from scaleout.optim.bytecount import ByteCounter, step_bytes
from tests.fakecuda import FakeCuda
from tests.optim.test_optim import (
    assert_close,
    grads_for,
    groups_of,
    make_params,
    ref_lamb,
    ref_lars,
)

# BERT-like shapes at 1/16 of the hidden size: a weight matrix, its bias, a LayerNorm pair
SHAPES = [(1907, 48), (512, 48), (48, 48), (48,), (192, 48), (192,), (48, 192), (48,), (48,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def _groups(ps: list[torch.nn.Parameter], wd: float) -> list[dict]:
    return [
        {"params": [p for p in ps if p.dim() > 1], "weight_decay": wd},
        {"params": [p for p in ps if p.dim() == 1], "weight_decay": 0.0},
    ]


def _bytes(make, fake_cuda: bool = False) -> tuple[float, int]:
    """Bytes per parameter of the second step (the first allocates state), and the host syncs."""
    ps = _params()
    if not fake_cuda:
        opt = make(ps)
        opt.step()
        return step_bytes(opt.step, ps)[0], 0
    with FakeCuda() as fc:
        opt = make(ps)
        opt.step()
        before = len(fc.syncs)
        per_param = step_bytes(opt.step, ps)[0]
        return per_param, len(fc.syncs) - before


@pytest.mark.unit
def test_lamb_and_lars_move_at_most_1_5x_the_bytes_of_fused_adamw_and_sgd() -> None:
    """The step a GPU runs, counted on CPU: under the emulated CUDA device (tests/fakecuda.py, a
    mock of the GPU that cannot exist here) the optimizers take their accelerator path, and the
    byte counter sums every op's operands, which is what each kernel streams from GPU memory.

    References, counted by the same counter: torch.optim.AdamW(fused=True) and SGD(momentum=0.9,
    fused=True), which torch 2.13 implements on CPU with the same one-kernel-per-list ops as on
    CUDA: 28 B/param (fp32 p, g, m, v read; p, m, v written) and 20 (p, g, b read; p, b written),
    the analytic values. Before the one-pass ops, LAMB moved 100 B/param (3.6x) and LARS 52 (2.6x);
    now 40 (moments + norms in one pass, the update in another) and 28 (two norm reads + one pass).
    LAMB's global clipping (off here and in OptimConfig) would add one read of g, as
    clip_grad_norm_ adds to AdamW."""
    adamw, _ = _bytes(lambda ps: torch.optim.AdamW(_groups(ps, 0.01), lr=1e-3, fused=True))
    sgd, _ = _bytes(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True))
    assert adamw == pytest.approx(28, abs=0.01) and sgd == pytest.approx(20, abs=0.01)
    lamb, lamb_syncs = _bytes(lambda ps: LAMB(_groups(ps, 0.01), lr=1e-3), fake_cuda=True)
    lars, lars_syncs = _bytes(lambda ps: LARS(_groups(ps, 5e-5), lr=0.1), fake_cuda=True)
    assert lamb <= 1.5 * adamw, f"LAMB {lamb:.1f} B/param vs fused AdamW {adamw:.1f}"
    assert lars <= 1.5 * sgd, f"LARS {lars:.1f} B/param vs fused SGD {sgd:.1f}"
    assert lamb_syncs == lars_syncs == 0  # the trust ratios stay on the device


@pytest.mark.unit
def test_byte_counter_rule() -> None:
    """Views are free; a tensor read twice by one op counts once; an in-place op reads and writes
    its target; copy_ does not read its destination."""
    a, b = torch.ones(10), torch.ones(10)
    with ByteCounter() as bc:
        v = a.view(2, 5).t()
        a.addcmul_(b, b)  # reads a, b; writes a
        a.copy_(b.view(2, 5).t().t().reshape(-1))  # reads b; writes a
        assert v.shape == (5, 2)
    assert (bc.read, bc.written) == (80 + 40, 40 + 40), bc.table()


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [None, 7, "auto"])
def test_onepass_kernels_equal_the_foreach_chains(chunk) -> None:
    """The one-pass ops' portable kernels give the foreach paths' results bit for bit (LAMB with
    global clipping and the trust clamp; LARS adapted and excluded groups; zero weights, a
    non-contiguous parameter), and both stay within the float64 references of test_optim."""
    steps = [grads_for(s, make_params(), seed=3) for s in range(3)]
    kw = dict(lr=0.05, betas=(0.9, 0.99), clip_grad_norm=1.0, trust_clamp=5.0, chunk=chunk)
    finals = []
    for onepass in (False, True):
        ps = make_params()
        opt = LAMB(groups_of(ps, 0.1), onepass=onepass, **kw)
        for grads in steps:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt.step()
        finals.append([p.detach().clone() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    ref = ref_lamb(make_params(), steps, 0.05, (0.9, 0.99), 1e-6, 0.1, clip=1.0, clamp=5.0)
    assert_close(finals[1], ref, 2e-5)
    lars = []
    for onepass in (False, True):
        ps = make_params()
        opt = LARS(groups_of(ps, 1e-3), lr=2.0, chunk=chunk, fused=False, onepass=onepass)
        for grads in steps:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt.step()
        lars.append([p.detach().clone() for p in ps])
    assert all(torch.equal(a, b) for a, b in zip(*lars, strict=True))
    assert_close(lars[1], ref_lars(make_params(), steps, 2.0, 0.9, 1e-3, 0.001), 2e-5)


@pytest.mark.unit
@pytest.mark.gpu
def test_compiled_cuda_kernels_agree_with_the_foreach_chains() -> None:
    """On a real GPU the one-pass ops run torch.compile'd kernels, which round differently (fused
    multiply-adds, another summation order): within 1e-5 of the foreach chain after 4 steps, and
    counted at 40 / 28 B per parameter."""
    steps = [[g.cuda() for g in grads_for(s, make_params(), seed=4)] for s in range(4)]
    for make in (
        lambda ps, o: LAMB(groups_of(ps, 0.1), lr=0.05, onepass=o),
        lambda ps, o: LARS(groups_of(ps, 1e-3), lr=2.0, onepass=o),
    ):
        finals = []
        for onepass in (False, True):
            ps = [torch.nn.Parameter(p.detach().cuda()) for p in make_params()]
            opt = make(ps, onepass)
            for grads in steps:
                for p, g in zip(ps, grads, strict=True):
                    p.grad = g
                opt.step()
            finals.append([p.detach().double().cpu() for p in ps])
        assert_close(finals[1], finals[0], 1e-5)
    lamb = _bytes_cuda(lambda ps: LAMB(_groups(ps, 0.01), lr=1e-3))
    lars = _bytes_cuda(lambda ps: LARS(_groups(ps, 5e-5), lr=0.1))
    assert lamb == pytest.approx(40, abs=0.5) and lars == pytest.approx(28, abs=0.5)


def _bytes_cuda(make) -> float:
    ps = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    for p, q in zip(ps, _params(), strict=True):
        p.grad = q.grad.cuda()
    opt = make(ps)
    opt.step()
    return step_bytes(opt.step, ps)[0]
