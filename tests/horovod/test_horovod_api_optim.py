"""Horovod's torch API tests, ported (see tests/horovod/test_horovod_api.py): DistributedOptimizer,
broadcast of parameters, optimizer state and objects, compression."""

from __future__ import annotations

import inspect
import itertools
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.horovod.test_horovod_api import on_ranks, raises

# Every torch optimizer, as Horovod's tests take them, except L-BFGS (closure-driven), SparseAdam
# (needs sparse gradients) and Muon (newer than those tests: it accepts only 2-D parameters, the
# models have biases).
OPTIMIZERS = sorted(
    (c.__name__, c)
    for c in torch.optim.Optimizer.__subclasses__()
    if c.__module__.startswith("torch.optim")
    and c not in (torch.optim.LBFGS, torch.optim.SparseAdam, getattr(torch.optim, "Muon", None))
)
OPT_PARAMS = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]


def _new_optimizer(cls, params, model):
    return cls(
        model.parameters(),
        **{k: v for k, v in params.items() if k in inspect.signature(cls.__init__).parameters},
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 10))


def _same_on_all_ranks(hvd, model: nn.Module) -> bool:
    mine = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return all(
        all(torch.equal(mine[k], other[k]) for k in mine) for other in hvd.allgather_object(mine)
    )


# -- broadcast of state ----------------------------------------------------------------------------
def _opt_values(optimizer):
    sd = optimizer.state_dict()
    return [
        (k, v.clone() if torch.is_tensor(v) else v)
        for g in sd["param_groups"]
        for pid in g["params"]
        if pid in sd["state"]
        for k, v in sorted(sd["state"][pid].items())
    ]


def r_broadcast_state(hvd):
    x, y = torch.randn(64, 100), torch.randn(64, 10)  # different on every rank
    for (_, cls), params in itertools.product(OPTIMIZERS, OPT_PARAMS):

        def create(cls=cls, params=params):
            model = _mlp()
            return model, hvd.DistributedOptimizer(
                _new_optimizer(cls, params, model), named_parameters=model.named_parameters()
            )

        model, opt = create()
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        model_values = [(k, v.clone()) for k, v in sorted(model.state_dict().items())]
        for name, v in model_values:
            hvd.broadcast_(v, root_rank=0, name=name)
        opt_values = [
            (
                k,
                hvd.broadcast_(v, 0, name=f"{k}.t")
                if torch.is_tensor(v)
                else hvd.broadcast_object(v, name=k),
            )
            for k, v in _opt_values(opt)
        ]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt.pt")
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            model, opt = create()  # fresh everywhere; rank 0 restores its checkpoint
            if hvd.rank() == 0:
                ckpt = torch.load(path, weights_only=False)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        after = sorted(model.state_dict().items())
        assert [k for k, _ in after] == [k for k, _ in model_values]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, model_values, strict=True))
        n_states = hvd.broadcast_object(len(opt.state_dict()["state"]))
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        assert len(opt.state_dict()["state"]) == n_states, cls.__name__
        for (k, a), (k2, b) in zip(_opt_values(opt), opt_values, strict=True):
            assert k == k2 and type(a) is type(b), (cls.__name__, k)
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, (cls.__name__, k)


@pytest.mark.multi_process
def test_broadcast_state():
    """Every optimizer: after a step on rank-specific data, a checkpoint restored on rank 0 only
    reaches every rank through broadcast_parameters + broadcast_optimizer_state, values and types
    intact."""
    on_ranks(r_broadcast_state, timeout=600)


def r_broadcast_state_options(hvd):
    x, y = torch.randn(64, 100), torch.randn(64, 10)
    p0 = dict(
        lr=0.1,
        momentum=0.8,
        weight_decay=0.2,
        nesterov=True,
        betas=(0.9, 0.999),
        etas=(0.8, 2.4),
        step_sizes=(1e-5, 100),
    )
    p1 = dict(
        lr=0.2,
        momentum=0.9,
        weight_decay=0.1,
        nesterov=False,
        betas=(0.8, 0.9),
        etas=(0.25, 1.75),
        step_sizes=(1e-7, 5),
    )
    for _, cls in OPTIMIZERS:
        model = _mlp()
        opt = hvd.DistributedOptimizer(
            _new_optimizer(cls, p0 if hvd.rank() == 0 else p1, model),
            named_parameters=model.named_parameters(),
        )
        for _ in range(
            2
        ):  # the second step checks that the received option types work in the update
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            for k, want in p0.items():
                if k in inspect.signature(cls.__init__).parameters:
                    got = opt.param_groups[0][k]
                    assert type(got) is type(want) and got == want, (cls.__name__, k, got)


@pytest.mark.multi_process
def test_broadcast_state_options():
    """Rank 0's hyper-parameters (lr, momentum, betas, ...) replace the others', with their Python
    types."""
    on_ranks(r_broadcast_state_options, timeout=600)


def _state_of(opt) -> dict:
    return {
        pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        for pid, st in opt.state_dict()["state"].items()
    }


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[pid].keys() == b[pid].keys()
        and all(
            torch.equal(x, b[pid][k]) if torch.is_tensor(x) else x == b[pid][k]
            for k, x in a[pid].items()
        )
        for pid in a
    )


def r_broadcast_state_lazy(hvd):
    """Root stepped with a gradient for the first layer only, rank 1 for the second layer only,
    ranks 2 and 3 never: their state keys all differ before the broadcast."""
    rank = hvd.rank()
    stateful = []
    for (name, cls), params in itertools.product(OPTIMIZERS, OPT_PARAMS):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
        opt = _new_optimizer(cls, params, model)
        if rank < 2:
            layer = model[rank]
            layer(torch.randn(3, layer.in_features)).sum().backward()
            opt.step()
        values = [p.detach().clone() for p in model.parameters()]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        fresh = not opt.state_dict()["state"]  # Horovod's test for its initialising step
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        if not fresh:  # state for some parameters: theirs created, parameters and gradients kept
            assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))
            assert all(
                (g is None and p.grad is None) or torch.equal(p.grad, g)
                for p, g in zip(model.parameters(), grads, strict=True)
            ), name
        else:  # a fresh optimizer: Horovod's zero-gradient step leaves zero gradients
            assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters()), name
        state = _state_of(opt)
        assert all(_same_state(state, other) for other in hvd.allgather_object(state)), name
        if state:  # every trainable parameter has state, the one root never had a gradient for too
            assert sorted(state) == [0, 1, 2, 3], (name, sorted(state))
            stateful.append(name)
        opt.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        opt.step()  # the received state works in an update
    # A fresh DistributedOptimizer: state created without its all-reducing step, then a real step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = _state_of(opt)
    assert sorted(state) == [0, 1, 2, 3] and all(s["step"].item() == 1 for s in state.values())
    assert all(_same_state(state, other) for other in hvd.allgather_object(state))
    opt.zero_grad()
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return sorted(set(stateful)), _same_on_all_ranks(hvd, model)


@pytest.mark.multi_process
def test_broadcast_state_lazy():
    """Horovod's lazy-state rule: parameters without state (no gradient yet on some ranks, or before
    the first step) get it on every rank before the broadcast, so every rank ends with root's state,
    with the same keys, for every optimizer; where the optimizer had state for some parameters,
    the parameters and their gradients are left as they were (a fresh one:
    test_broadcast_state_fresh)."""
    out = on_ranks(r_broadcast_state_lazy, timeout=600)
    stateful, same = zip(*out, strict=True)
    assert all(same) and len(set(map(tuple, stateful))) == 1
    assert {"Adam", "RMSprop", "SGD"} <= set(stateful[0])


def r_broadcast_state_fresh(hvd):
    """A fresh optimizer with weight decay, after a backward pass: what broadcast_optimizer_state
    leaves in the parameters and their gradients, per optimizer."""
    torch.manual_seed(0)
    out = {}
    for cls, kw in (
        (torch.optim.SGD, dict(lr=0.1, weight_decay=0.5)),
        (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.5)),
        (torch.optim.Adam, dict(lr=0.1)),
    ):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        model[1].bias.requires_grad_(False)  # a frozen parameter: Horovod gives it no gradient
        model(torch.randn(5, 4)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt = cls(model.parameters(), **kw)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        params = list(model.parameters())
        out[cls.__name__] = {
            "moved": [not torch.equal(p, b) for p, b in zip(params, before, strict=True)],
            # decoupled or L2 decay at a zero gradient: p (1 - lr wd); Adam without decay: 0
            "decayed": all(
                torch.allclose(p, b * (1 - kw["lr"] * kw.get("weight_decay", 0.0)))
                for p, b in zip(params, before, strict=True)
                if p.requires_grad
            ),
            "grads": [
                None if p.grad is None else bool(torch.equal(p.grad, torch.zeros_like(p)))
                for p in params
            ],
            "state": sorted(_state_of(opt)),
        }
    return out


@pytest.mark.multi_process
def test_broadcast_state_fresh():
    """On a fresh optimizer the state is created as Horovod creates it
    (horovod/torch/functions.py): every trainable parameter's gradient is replaced by zeros and the
    optimizer steps once, and what that step did stays -- zero gradients, parameters moved by the
    weight decay (SGD, AdamW), untouched where the update is zero (Adam). The frozen parameter keeps
    no gradient. (scaleout.horovod used to put the old gradients and values back.)"""
    for out in on_ranks(r_broadcast_state_fresh):
        trainable = [True, True, True, False]
        assert out["SGD"]["moved"] == trainable and out["SGD"]["decayed"]
        assert out["AdamW"]["moved"] == trainable and out["AdamW"]["decayed"]
        assert out["Adam"]["moved"] == [False] * 4 and out["Adam"]["decayed"]
        for name in ("SGD", "AdamW", "Adam"):
            assert out[name]["grads"] == [True, True, True, None], name
            assert out[name]["state"] == ([] if name == "SGD" else [0, 1, 2]), name


class _ModelNoGrad(nn.Module):
    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(a.int(), requires_grad=False)
        self.b = nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def r_broadcast_state_no_grad(hvd):
    torch.manual_seed(hvd.rank())
    model = _ModelNoGrad(torch.tensor([1, 3]), torch.rand(4))
    opt = torch.optim.SGD(
        model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True
    )
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["params"][0].grad is None  # the integer, frozen parameter
    # Horovod's own check: the initialising step's zero gradient, equal on all ranks
    assert torch.equal(model.b.grad, torch.zeros(4))
    assert all(torch.equal(g, model.b.grad) for g in hvd.allgather_object(model.b.grad))
    model(torch.ones(2)).sum().backward()
    opt.step()
    return _same_on_all_ranks(hvd, model)


@pytest.mark.multi_process
def test_broadcast_state_no_grad():
    """A frozen integer parameter neither breaks the broadcasts nor gets a gradient; the trainable
    parameter's zero gradient, left by the initialising step, is equal on all ranks (as Horovod's
    test asserts); training then works."""
    assert on_ranks(r_broadcast_state_no_grad) == [True] * 4


# -- objects and compression -----------------------------------------------------------------------
def r_objects(hvd):
    obj = hvd.broadcast_object({"hello": 123, 0: [1, 2]} if hvd.rank() == 0 else {}, root_rank=0)
    d = {"metric_val_1": hvd.rank()}
    if hvd.rank() == 1:
        d["metric_val_2"] = 42
    return obj, hvd.allgather_object(d)


@pytest.mark.multi_process
def test_broadcast_object_and_allgather_object():
    for obj, gathered in on_ranks(r_objects):
        assert obj == {"hello": 123, 0: [1, 2]}
        assert gathered == [
            {"metric_val_1": 0},
            {"metric_val_1": 1, "metric_val_2": 42},
            {"metric_val_1": 2},
            {"metric_val_1": 3},
        ]


@pytest.mark.unit
def test_compression_fp16():
    """fp16 compression casts floating tensors to fp16 and back; other dtypes pass through."""
    import scaleout.horovod as hvd

    for dtype in (torch.float32, torch.float64):
        wire, ctx = hvd.Compression.fp16.compress(torch.ones(5, 5, 5, dtype=dtype))
        back = hvd.Compression.fp16.decompress(wire, ctx)
        assert (
            wire.dtype == torch.float16
            and back.dtype == dtype
            and np.linalg.norm(1 - back.numpy()) < 1e-8
        )
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        wire, ctx = hvd.Compression.fp16.compress(torch.ones(5, 5, 5, dtype=dtype))
        back = hvd.Compression.fp16.decompress(wire, ctx)
        assert wire.dtype == dtype and back.dtype == dtype and bool((back == 1).all())


# -- DistributedOptimizer --------------------------------------------------------------------------
class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(100, 10), nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc2(F.relu(self.fc1(x)))
        return h, self.fc3(F.relu(h))


def _head_loss(model: nn.Module, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 100, generator=g), torch.randn(64, 10, generator=g)
    y1, y2 = model(x)
    return F.mse_loss(y1 if rank == 0 else y2, y, reduction="sum")  # rank 0 never uses fc3


def r_force_allreduce(hvd):
    rank, size = hvd.rank(), hvd.size()
    for (name, cls), params in itertools.product(OPTIMIZERS, OPT_PARAMS):
        torch.manual_seed(0)
        model = _TwoHeads()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(
            _new_optimizer(cls, params, model), named_parameters=model.named_parameters()
        )
        opt.zero_grad()
        _head_loss(model, rank).backward()
        opt.step()
        assert _same_on_all_ranks(hvd, model), name
        if (
            cls is torch.optim.SGD and params == OPT_PARAMS[1]
        ):  # plain SGD: check the averaged gradient
            torch.manual_seed(0)
            ref = _TwoHeads()
            (sum(_head_loss(ref, r) for r in range(size)) / size).backward()
            for (k, p), (_, q) in zip(
                model.named_parameters(), ref.named_parameters(), strict=True
            ):
                assert torch.allclose(p, q.detach() - 0.2 * q.grad, rtol=1e-5, atol=1e-5), k


@pytest.mark.multi_process
def test_force_allreduce():
    """A parameter used on some ranks only (fc3 gets no gradient on rank 0) is reduced with every
    rank taking part: no mixing with other gradients, no hang; every optimizer; plain SGD matches
    one process averaging the four losses."""
    on_ranks(r_force_allreduce, timeout=600)


def r_named_parameters_errors(hvd):
    net1, net2 = nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(itertools.chain(net1.parameters(), net2.parameters()), lr=0.1)
    dup = raises(
        lambda: hvd.DistributedOptimizer(
            opt, named_parameters=itertools.chain(net1.named_parameters(), net2.named_parameters())
        ),
        (ValueError,),
    )
    model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    missing = raises(
        lambda: hvd.DistributedOptimizer(opt, named_parameters=list(model.named_parameters())[:1]),
        (ValueError,),
    )
    return dup, missing


@pytest.mark.multi_process
def test_duplicate_and_missing_named_parameters():
    dup, missing = on_ranks(r_named_parameters_errors)[0]
    assert "duplicates ['bias', 'weight']" in dup
    assert "does not name 3 optimizer parameter(s)" in missing


def r_no_named_parameters(hvd):
    model = nn.Sequential(nn.Conv2d(1, 100, 1), nn.Conv2d(100, 1, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    model(
        torch.rand(1, 1, 50, 50)
    ).sum().backward()  # Horovod's test uses 1000 x 1000: same path, 400 MB less
    opt.step()
    two_groups = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(
            [{"params": two_groups[0].parameters()}, {"params": two_groups[1].parameters()}],
            lr=0.001,
        )
    )
    names = set(opt._parameter_names.values())
    assert len(names) == len(opt._parameter_names) == 4
    return _same_on_all_ranks(hvd, model), hvd.allgather_object(names)


@pytest.mark.multi_process
def test_no_named_parameters():
    """Without named_parameters every parameter gets a generated name, unique and the same on all
    ranks."""
    for same, names in on_ranks(r_no_named_parameters):
        assert same and all(n == names[0] for n in names)


def r_dynamic_requires_grad(hvd):
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand(1, 1, 100, 100)
    gen_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(gen.parameters(), lr=0.1), named_parameters=gen.named_parameters()
    )
    disc_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(disc.parameters(), lr=0.1), named_parameters=disc.named_parameters()
    )
    for _ in range(10):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for module, trained in ((gen, train_gen), (disc, not train_gen)):
                for p in module.parameters():
                    assert trained == (p.grad is not None and bool(p.grad.max() != 0))
            (gen_opt if train_gen else disc_opt).step()


@pytest.mark.multi_process
def test_dynamic_requires_grad():
    """GAN-style alternation: gradients switched off and on between steps, each optimizer steps its
    half."""
    on_ranks(r_dynamic_requires_grad)


def _one_unit_model(hvd, x_value: float):
    model = nn.Linear(1, 1)
    model.weight = nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = nn.Parameter(torch.zeros(1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    opt.zero_grad()
    F.mse_loss(model(torch.full((1, 1), x_value)), torch.ones(1, 1)).backward()
    opt.synchronize()
    return model, opt


def r_gradient_clipping(hvd):
    model, opt = _one_unit_model(hvd, 1.0)
    prior = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert abs(prior) > abs(model.weight.grad.item())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    assert not [w for w in caught if "skip_synchronize" in str(w.message)]
    model, opt = _one_unit_model(hvd, 0.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]


@pytest.mark.multi_process
def test_gradient_clipping_and_synchronize_step_warning():
    """synchronize(); clip; step() inside skip_synchronize() works silently; step() after
    synchronize() without it warns (once) that the gradients are reduced again."""
    for messages in on_ranks(r_gradient_clipping):
        assert len(messages) == 1
        assert "optimizer.step() called without optimizer.skip_synchronize()" in messages[0]


class _Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 3, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x)


def r_sparse_embeddings(hvd, sparse_as_dense):
    torch.manual_seed(0)
    model = _Embedding()
    inp = (
        torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]])
        if hvd.rank() == 0
        else torch.tensor([[1, 3, 4], [4, 7, 9]])
    )
    opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(model.parameters()), lr=0.1), sparse_as_dense=sparse_as_dense
    )
    before = model.embedding.weight.detach().clone()
    opt.zero_grad()
    model(inp).sum().backward()
    opt.step()
    moved = (model.embedding.weight.detach() != before).any(dim=1).nonzero().flatten().tolist()
    return _same_on_all_ranks(hvd, model), moved


@pytest.mark.multi_process
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embeddings(sparse_as_dense):
    """Sparse embedding gradients (different rows on different ranks) reduced by allgather or as
    dense: every rank applies the same update, to exactly the rows some rank used."""
    for same, moved in on_ranks(r_sparse_embeddings, sparse_as_dense):
        assert same and moved == [1, 2, 3, 4, 5, 7, 9]
