"""scaleout.horovod's single-process facts: what the build reports (``hvd.*_built``), the
compression vocabulary shared with the gradient reducer, and Horovod's fusion rule beside DDP's
bucket rule."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest
import torch
import torch.distributed as dist

import scaleout.horovod as hvd
from scaleout.comm import get_algorithm
from scaleout.horovod.basics import _default_algorithm
from scaleout.horovod.errors import HorovodValueError
from scaleout.horovod.negotiate import FIELDS, Kind
from scaleout.parallel.buckets import assign, fuse
from scaleout.parallel.reducer import COMPRESSION, compression_dtype

pytestmark = pytest.mark.unit


# -- what the build has ----------------------------------------------------------------------------
def test_built_flags_follow_torch() -> None:
    assert hvd.gloo_built() is dist.is_gloo_available()
    assert hvd.gloo_enabled() is dist.is_gloo_available()
    assert hvd.mpi_built() is dist.is_mpi_available()
    assert hvd.mpi_enabled() is False  # the World's backends are gloo and NCCL
    assert hvd.cuda_built() is torch.backends.cuda.is_built()
    assert hvd.rocm_built() is (torch.version.hip is not None)
    assert hvd.nccl_built() == 0 or dist.is_nccl_available()


@pytest.mark.parametrize("available", [True, False])
def test_gloo_and_mpi_built_are_not_constants(monkeypatch: pytest.MonkeyPatch, available: bool):
    monkeypatch.setattr(dist, "is_gloo_available", lambda: available)
    monkeypatch.setattr(dist, "is_mpi_available", lambda: available)
    assert hvd.gloo_built() is available and hvd.gloo_enabled() is available
    assert hvd.mpi_built() is available and hvd.mpi_enabled() is False


@pytest.mark.parametrize(
    ("available", "version", "code"),
    [(False, (2, 21, 5), 0), (True, (2, 21, 5), 22105), (True, (2, 8, 4), 2804)],
)
def test_nccl_built_is_horovods_version_code(
    monkeypatch: pytest.MonkeyPatch, available, version, code
):
    """Horovod's nccl_built() is NCCL_VERSION_CODE: X*10000 + Y*100 + Z since NCCL 2.9, X*1000
    before."""
    monkeypatch.setattr(dist, "is_nccl_available", lambda: available)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    assert hvd.nccl_built() == code


# -- one compression vocabulary --------------------------------------------------------------------
def test_compression_is_the_reducers_dtype_table() -> None:
    """hvd.Compression.fp16 and the reducer's 'fp16' once were two tables; now each compressor is an
    entry of the reducer's, and every reducer name is a compressor."""
    for comp in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16):
        assert comp.dtype == compression_dtype(comp.name)
        wire, ctx = comp.compress(torch.ones(4))
        assert wire.dtype == (comp.dtype or torch.float32)
        assert comp.decompress(wire, ctx).dtype == torch.float32
    for name in COMPRESSION:
        assert hvd.Compression.of(name).dtype == compression_dtype(name)
    assert hvd.Compression.of(hvd.Compression.fp16) is hvd.Compression.fp16
    with pytest.raises(HorovodValueError, match="compression='int8'"):
        hvd.Compression.of("int8")


# -- fusion (Horovod) vs buckets (DDP) -------------------------------------------------------------
def test_fusion_caps_from_above_buckets_from_below() -> None:
    """Horovod fuses at most the threshold (a larger tensor alone; 0: each alone); DDP closes a
    bucket once it holds at least the cap. Same sizes, different groupings, both in
    parallel/buckets.py."""
    sizes = [3, 3, 3, 9, 1]
    assert fuse(sizes, 5) == [[0], [1], [2], [3], [4]]
    assert fuse(sizes, 6) == [[0, 1], [2], [3], [4]]
    assert fuse(sizes, 0) == [[i] for i in range(len(sizes))]
    assert fuse(sizes, 100) == [list(range(len(sizes)))]
    assert assign(sizes, [0] * len(sizes), 5) == [[0, 1], [2, 3], [4]]


# -- the algorithm Horovod's variables select ------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, "flat"),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, "hierarchical"),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}, "flat"),
        ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "SCALEOUT_ALGORITHM": "flat"}, "flat"),
    ],
)
def test_horovod_variables_select_a_registered_algorithm(monkeypatch, env, want) -> None:
    """HOROVOD_HIERARCHICAL_ALLREDUCE maps onto a name of the comm registry ($SCALEOUT_ALGORITHM
    wins)."""
    for k in ("HOROVOD_HIERARCHICAL_ALLREDUCE", "SCALEOUT_ALGORITHM"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _default_algorithm() == want
    get_algorithm(want)  # registered: a renamed algorithm fails here, not at hvd.init on a cluster


def test_every_request_kind_says_what_ranks_agree_on() -> None:
    assert sorted(FIELDS) == sorted(get_args(Kind))


# -- an optional part ------------------------------------------------------------------------------
def test_nothing_outside_the_shim_imports_it() -> None:
    """scaleout.horovod is optional (scaleout/horovod/README.md): no module of scaleout/ or
    launchers/ outside scaleout/horovod/ imports it, at the top or inside a function, so removing
    the folder leaves the framework whole."""
    root = Path(__file__).resolve().parents[2]
    shim = root / "scaleout" / "horovod"
    users = []
    for path in [*(root / "scaleout").rglob("*.py"), *(root / "launchers").rglob("*.py")]:
        if shim in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else []
            )
            if any(n == "scaleout.horovod" or n.startswith("scaleout.horovod.") for n in names):
                users.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not users, f"modules that import the optional Horovod shim: {users}"
