"""LAMB, LARS, groups, schedule and factory against plain implementations of the paper equations.

The references below loop over tensors in float64, exactly as the equations read (LAMB: arXiv
1904.00962 with NVIDIA's clipping and exclusions; LARS: the MLPerf ResNet TensorFlow reference). The
optimizers under test run in fp32 with several chunk sizes, so chunks split tensors and mix several
tensors per chunk.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from scaleout.config.schema import OptimConfig
from scaleout.errors import ConfigError
from scaleout.families.bert import NVIDIA_BERT_NO_DECAY
from scaleout.families.resnet import LARS_EXCLUDE
from scaleout.optim import (
    LAMB,
    LARS,
    WarmupPoly,
    build_optimizer,
    build_schedule,
    param_groups,
    state_bytes,
    warmup_poly,
)

SHAPES = [(6, 5), (7,), (3, 4, 2), (4, 4), (9,), (5,)]
DECAY = [0, 2, 3]  # adapted, decayed
ZERO_W = 3  # a weight that starts at 0: ||w|| = 0 -> trust ratio 1
ZERO_ALL = 5  # an excluded tensor with w = 0 and g = 0 (both norms 0)


def make_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, s in enumerate(SHAPES):
        t = torch.randn(s, generator=g) * 0.5
        if i in (ZERO_W, ZERO_ALL):
            t.zero_()
        ps.append(torch.nn.Parameter(t.to(dtype)))
    # a non-contiguous parameter (kept whole by the chunker)
    ps.append(torch.nn.Parameter(torch.randn(3, 5, generator=g).t().to(dtype)))
    return ps


def grads_for(step: int, params, seed: int = 1, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for i, p in enumerate(params):
        t = torch.randn(p.shape, generator=g) * scale * (1 + i)
        if i == ZERO_ALL:
            t.zero_()
        out.append(t)
    return out


def groups_of(params, wd: float):
    decay = [p for i, p in enumerate(params) if i in DECAY or i == len(SHAPES)]
    rest = [p for i, p in enumerate(params) if not (i in DECAY or i == len(SHAPES))]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def ref_lamb(
    params, grads_per_step, lr, betas, eps, wd, clip=None, clamp=None, bias_correction=True
):
    """Plain LAMB: per-tensor loops in float64."""
    b1, b2 = betas
    w = [p.detach().double().cpu().clone() for p in params]
    adapt = [i in DECAY or i == len(SHAPES) for i in range(len(w))]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        gs = [g.double() for g in grads]
        c = 1.0
        if clip is not None:
            total = math.sqrt(sum(float((g * g).sum()) for g in gs))
            c = clip / max(total, clip)
        for i in range(len(w)):
            g = gs[i] * c
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
            u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + (wd if adapt[i] else 0.0) * w[i]
            r = 1.0
            if adapt[i]:
                wn, un = float(w[i].norm()), float(u.norm())
                r = wn / un if wn > 0 and un > 0 else 1.0
                if clamp is not None:
                    r = min(r, clamp)
            w[i] = w[i] - lr * r * u
    return w


def ref_lars(params, grads_per_step, lr, momentum, wd, eta, eps=0.0):
    """MLPerf ResNet reference LARS, per tensor in float64."""
    w = [p.detach().double().cpu().clone() for p in params]
    adapt = [i in DECAY or i == len(SHAPES) for i in range(len(w))]
    b = [torch.zeros_like(x) for x in w]
    for grads in grads_per_step:
        for i in range(len(w)):
            g = grads[i].double()
            slr = lr
            if adapt[i]:
                wn, gn = float(w[i].norm()), float(g.norm())
                trust = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                slr = lr * trust
                g = g + wd * w[i]
            b[i] = momentum * b[i] + slr * g
            w[i] = w[i] - b[i]
    return w


def run(opt_factory, params, grads_per_step):
    opt = opt_factory(params)
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
    return opt


def assert_close(params, ref, rtol):
    for i, (p, r) in enumerate(zip(params, ref, strict=True)):
        err = float((p.detach().double() - r).abs().max())
        assert err <= rtol * max(float(r.abs().max()), 1e-3), (
            f"tensor {i} {tuple(p.shape)}: max error {err:.3g}"
        )


@pytest.mark.multi_process
@pytest.mark.parametrize("chunk", [None, 7, 64, "auto"])
@pytest.mark.parametrize("clip, clamp", [(None, None), (1.0, 0.9)])
def test_lamb_matches_paper_equations(chunk, clip, clamp):
    params = make_params()
    steps = [grads_for(s, params) for s in range(5)]
    hp = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)
    ref = ref_lamb(params, steps, wd=0.1, clip=clip, clamp=clamp, **hp)
    opt = run(
        lambda ps: LAMB(
            groups_of(ps, 0.1), clip_grad_norm=clip, trust_clamp=clamp, chunk=chunk, **hp
        ),
        params,
        steps,
    )
    assert_close(params, ref, 2e-5)
    assert all(g["step"] == 5 for g in opt.param_groups)
    # the excluded zero tensor (w = 0, g = 0) did not move; the zero-initialised decayed one did
    # (ratio 1)
    assert (
        float(params[ZERO_ALL].detach().abs().max()) == 0.0
        and float(params[ZERO_W].detach().abs().max()) > 0.0
    )
    if clip is not None:  # grads here have norm >> 1, so clipping really changed the result
        unclipped = ref_lamb(params, steps, wd=0.1, clip=None, clamp=clamp, **hp)
        assert max(float((a - b).abs().max()) for a, b in zip(ref, unclipped, strict=True)) > 1e-3


@pytest.mark.unit
def test_lamb_without_bias_correction_and_forced_trust_ratio():
    params = make_params(3)
    steps = [grads_for(s, params, seed=4) for s in range(3)]
    ref = ref_lamb(
        params, steps, lr=0.02, betas=(0.8, 0.9), eps=1e-4, wd=0.05, bias_correction=False
    )
    run(
        lambda ps: LAMB(
            groups_of(ps, 0.05), lr=0.02, betas=(0.8, 0.9), eps=1e-4, bias_correction=False, chunk=5
        ),
        params,
        steps,
    )
    assert_close(params, ref, 2e-5)


@pytest.mark.unit
@pytest.mark.parametrize(
    "chunk, fused", [(None, False), (7, False), ("auto", False), ("auto", None)]
)
def test_lars_matches_mlperf_reference(chunk, fused):
    """Both CPU paths: multi-tensor foreach (fused=False) and torch's fused SGD kernel (the fp32
    default)."""
    params = make_params(1)
    steps = [grads_for(s, params, seed=2) for s in range(5)]
    ref = ref_lars(params, steps, lr=2.0, momentum=0.9, wd=1e-3, eta=0.001)
    opt = run(
        lambda ps: LARS(
            groups_of(ps, 1e-3), lr=2.0, momentum=0.9, eta=0.001, chunk=chunk, fused=fused
        ),
        params,
        steps,
    )
    assert opt._use_fused([params[0]], [params[0].grad]) == (fused is None)
    assert_close(params, ref, 2e-5)
    assert float(params[ZERO_ALL].detach().abs().max()) == 0.0


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_bf16_params_keep_fp32_state(kind):
    params = make_params(2, dtype=torch.bfloat16)
    steps = [grads_for(s, params, seed=5) for s in range(4)]
    if kind == "lamb":
        ref = ref_lamb(params, steps, lr=0.05, betas=(0.9, 0.99), eps=1e-6, wd=0.1)
        opt = run(
            lambda ps: LAMB(groups_of(ps, 0.1), lr=0.05, betas=(0.9, 0.99), chunk=7), params, steps
        )
    else:
        ref = ref_lars(params, steps, lr=2.0, momentum=0.9, wd=1e-3, eta=0.001)
        opt = run(lambda ps: LARS(groups_of(ps, 1e-3), lr=2.0, chunk=7), params, steps)
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(t.dtype == torch.float32 for s in opt.state.values() for t in s.values())
    assert_close(
        params, ref, 3e-2
    )  # bf16 keeps ~3 significant digits; the reference does not round
    start = make_params(2, dtype=torch.bfloat16)
    assert (
        max(
            float((p.detach().float() - q.detach().float()).abs().max())
            for p, q in zip(params, start, strict=True)
        )
        > 1e-2
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    "kind, dtype", [("lamb", torch.float32), ("lars", torch.float32), ("lamb", torch.bfloat16)]
)
def test_state_dict_round_trip_and_resume(kind, dtype):
    def make(ps):
        if kind == "lamb":
            return LAMB(groups_of(ps, 0.1), lr=0.05, clip_grad_norm=2.0, chunk=7)
        return LARS(groups_of(ps, 1e-3), lr=1.0, chunk=7)

    params = make_params(4, dtype)
    steps = [grads_for(s, params, seed=6) for s in range(6)]
    opt = run(make, params, steps[:3])
    saved_params = copy.deepcopy([p.detach() for p in params])
    saved = copy.deepcopy(opt.state_dict())
    for grads in steps[3:]:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dtype)
        opt.step()
    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    assert all(t.dtype == torch.float32 for s in opt2.state.values() for t in s.values())
    for grads in steps[3:]:
        for p, g in zip(resumed, grads, strict=True):
            p.grad = g.to(dtype)
        opt2.step()
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
    assert [g["step"] for g in opt2.param_groups] == [6, 6]


@pytest.mark.unit
def test_invalid_hyperparameters_raise_one_line_errors():
    ps = make_params()
    cases = [
        (lambda: LAMB(ps, lr=-1.0), "lr=-1.0"),
        (lambda: LAMB(ps, betas=(1.0, 0.999)), "betas[0]=1.0"),
        (lambda: LAMB(ps, betas=(0.9, -0.1)), "betas[1]=-0.1"),
        (lambda: LAMB(ps, eps=-1e-8), "eps=-1e-08"),
        (lambda: LAMB(ps, weight_decay=-0.1), "weight_decay=-0.1"),
        (lambda: LAMB(ps, clip_grad_norm=0.0), "clip_grad_norm=0.0"),
        (lambda: LAMB(ps, trust_clamp=-1.0), "trust_clamp=-1.0"),
        (lambda: LAMB([{"params": ps, "lr": float("nan")}]), "lr=nan"),
        (lambda: LAMB(ps, chunk=0), "chunk=0"),
        (lambda: LARS(ps, lr=-0.1), "lr=-0.1"),
        (lambda: LARS(ps, momentum=1.0), "momentum=1.0"),
        (lambda: LARS(ps, eta=0.0), "eta=0.0"),
        (lambda: LARS(ps, eps=-1.0), "eps=-1.0"),
        (lambda: WarmupPoly(warmup_steps=10, total_steps=10), "total_steps=10"),
        (lambda: param_groups(torch.nn.Linear(2, 2), 0.1, no_decay="bias"), "no_decay='bias'"),
    ]
    for make, needle in cases:
        with pytest.raises(ConfigError) as info:
            make()
        msg = str(info.value)
        assert needle in msg and "\n" not in msg, msg


@pytest.mark.unit
def test_schedule_warmup_then_polynomial_decay():
    opt = LAMB(make_params(), lr=2.0)
    sched = warmup_poly(opt, warmup_steps=4, total_steps=12, power=2.0, end_lr=0.5)
    seen = []
    for _ in range(14):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: nothing moves, but the scheduler sees the optimizer step first
        sched.step()
    expect = [2.0 * s / 4 for s in range(4)]
    expect += [(2.0 - 0.5) * (1 - (s - 4) / 8) ** 2 + 0.5 for s in range(4, 12)] + [0.5, 0.5]
    assert seen == pytest.approx(expect, rel=1e-12)
    bert = WarmupPoly(warmup_steps=4, total_steps=12, power=1.0, decay_from="start")
    assert (
        bert(2) == pytest.approx(0.5) and bert(4) == pytest.approx(1 - 4 / 12) and bert(20) == 0.0
    )
    assert WarmupPoly(warmup_steps=3)(100) == 1.0
    # the scheduler's state survives a round trip
    sched2 = warmup_poly(
        LAMB(make_params(), lr=2.0), warmup_steps=4, total_steps=12, power=2.0, end_lr=0.5
    )
    sched2.load_state_dict(sched.state_dict())
    assert sched2.last_epoch == sched.last_epoch


class TinyBert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = torch.nn.Embedding(10, 8)
        self.LayerNorm = torch.nn.LayerNorm(8)
        self.dense = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)  # named without a pattern: excluded by module type
        self.gamma = torch.nn.Parameter(torch.ones(8))
        self.decoder = torch.nn.Linear(8, 10, bias=False)
        self.decoder.weight = self.embeddings.weight  # tied: must appear once
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)


class TinyResNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.downsample = torch.nn.Sequential(
            torch.nn.Conv2d(4, 4, 1, bias=False), torch.nn.BatchNorm2d(4)
        )
        self.fc = torch.nn.Linear(4, 2)


@pytest.mark.unit
def test_param_groups_follow_nvidia_and_mlperf_rules():
    groups = param_groups(TinyBert(), 0.01, NVIDIA_BERT_NO_DECAY, lr=0.5)
    assert groups[0]["names"] == ["embeddings.weight", "dense.weight"]
    assert sorted(groups[1]["names"]) == sorted(
        ["LayerNorm.weight", "LayerNorm.bias", "dense.bias", "norm.weight", "norm.bias", "gamma"]
    )
    assert (
        groups[0]["weight_decay"],
        groups[0]["trust_ratio"],
        groups[1]["weight_decay"],
        groups[1]["trust_ratio"],
    ) == (0.01, True, 0.0, False)
    assert groups[0]["lr"] == groups[1]["lr"] == 0.5
    rgroups = param_groups(TinyResNet(), 5e-5, LARS_EXCLUDE)
    assert rgroups[0]["names"] == ["conv1.weight", "downsample.0.weight", "fc.weight"]
    assert len(rgroups[1]["names"]) == 5  # bn1 x2, downsample.1 x2 (by type), fc.bias


@pytest.mark.unit
def test_factory_builds_the_configured_optimizer_and_schedule():
    model = TinyBert()
    opt = build_optimizer(model, OptimConfig(name="lamb", lr=0.1, clip_grad_norm=1.0))
    assert isinstance(opt, LAMB) and opt.clip_grad_norm == 1.0 and len(opt.param_groups) == 2
    sched = build_schedule(opt, OptimConfig(lr=0.1, warmup_steps=2, total_steps=4))
    assert opt.param_groups[0]["lr"] == 0.0
    lars = build_optimizer(TinyResNet(), OptimConfig(name="lars", lr=1.0, weight_decay=5e-5))
    assert isinstance(lars, LARS) and lars.param_groups[0]["eta"] == 0.001
    adamw = build_optimizer(model, OptimConfig(name="adamw"))
    assert isinstance(adamw, torch.optim.AdamW)
    with pytest.raises(ConfigError, match="world"):
        build_optimizer(model, OptimConfig(name="lamb", sharded=True))
    with pytest.raises(ValueError, match="optim.name='lars'"):  # the schema's rule (OptimConfig)
        OptimConfig(name="lars", sharded=True)
    # one full step on a real model: the loss goes down
    x = torch.randint(0, 10, (16,))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        h = model.norm(model.dense(model.LayerNorm(model.embeddings(x)))) * model.gamma
        loss = model.decoder(h).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    assert opt.param_groups[0]["lr"] == pytest.approx(
        0.1 * (1 - 1 / 2)
    )  # step 3: decaying from warmup end
    assert losses[-1] < losses[0]
    assert state_bytes(opt) == 2 * 4 * sum(p.numel() for g in opt.param_groups for p in g["params"])


@pytest.mark.unit
def test_hot_path_has_no_python_loop_per_parameter(monkeypatch):
    """The number of foreach calls depends on the number of chunks, not of parameters. LARS's
    fused path is the exception by design: one fused-SGD kernel per adapted tensor (each has its
    own trust ratio)."""

    def count(n_params: int, kind: str) -> int:
        calls = 0
        for name in dir(torch):
            if name.startswith("_foreach_") or name == "_fused_sgd_":
                real = getattr(torch, name)

                def wrapped(*a, _real=real, **k):
                    nonlocal calls
                    calls += 1
                    return _real(*a, **k)

                monkeypatch.setattr(torch, name, wrapped)
        ps = [torch.nn.Parameter(torch.randn(3)) for _ in range(n_params)]
        for p in ps:
            p.grad = torch.randn(3)
        opt = (
            LAMB(ps, clip_grad_norm=1.0) if kind == "lamb" else LARS(ps, fused=kind == "lars-fused")
        )
        opt.step()
        monkeypatch.undo()
        return calls

    for kind in ("lamb", "lars"):
        assert count(10, kind) == count(200, kind) > 0
    # fused LARS: 2 norm calls + 1 kernel per tensor, and no more (no chain of ops per tensor)
    assert count(10, "lars-fused") == 2 + 10 and count(200, "lars-fused") == 2 + 200


@pytest.mark.unit
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_path_matches_the_reference(dtype):
    """The accelerator layout (whole tensors, device-side per-tensor scalars) on a real GPU."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(8, dtype)]
    steps = [[g.cuda() for g in grads_for(s, params, seed=9)] for s in range(4)]
    ref = ref_lamb(
        params,
        [[g.cpu() for g in gs] for gs in steps],
        lr=0.05,
        betas=(0.9, 0.99),
        eps=1e-6,
        wd=0.1,
        clip=1.0,
    )
    opt = run(
        lambda ps: LAMB(groups_of(ps, 0.1), lr=0.05, betas=(0.9, 0.99), clip_grad_norm=1.0),
        params,
        steps,
    )
    assert opt.plan([p for p in params]).num_chunks == 1
    assert_close([p.cpu() for p in params], ref, 2e-5 if dtype == torch.float32 else 3e-2)
    lparams = [torch.nn.Parameter(p.detach().cuda()) for p in make_params(8, dtype)]
    lref = ref_lars(
        lparams, [[g.cpu() for g in gs] for gs in steps], lr=2.0, momentum=0.9, wd=1e-3, eta=0.001
    )
    run(lambda ps: LARS(groups_of(ps, 1e-3), lr=2.0), lparams, steps)
    assert_close([p.cpu() for p in lparams], lref, 2e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.unit
@pytest.mark.parametrize("lr", [2.0, 1e-3, 1e-9])
def test_fused_lars_keeps_precision_for_tiny_lr_times_trust(lr):
    """The fused path passes dampening = 1 - lr t; the kernel must form 1 - dampening in double
    precision, or a small lr t (warm-up start, tiny trust ratio) would lose most of its digits.
    One step from a zero buffer: b = lr t (g + wd w), checked against the formula in float64 for
    every adapted tensor."""
    params = make_params(7)
    grads = grads_for(0, params, seed=7)
    w0 = [p.detach().double().clone() for p in params]
    opt = run(lambda ps: LARS(groups_of(ps, 1e-3), lr=lr, momentum=0.9, eta=0.001), params, [grads])
    assert opt._use_fused([params[0]], [params[0].grad])
    for i in DECAY:
        w, g = w0[i], grads[i].double()
        wn, gn = float(w.norm()), float(g.norm())
        t = 0.001 * wn / (gn + 1e-3 * wn) if wn > 0 and gn > 0 else 1.0
        ref = lr * t * (g + 1e-3 * w)
        got = opt.state[params[i]]["momentum_buffer"].double()
        assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), (i, lr)
