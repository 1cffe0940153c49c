"""A rank's start-up settings (scaleout/startup.py, scaleout/world.py, scaleout/store_share.py):
resource limits raised or refused in one line, the NCCL environment's defaults, ``device_id`` for
an eager NCCL init, and no eager world-wide gloo mesh (review gpu-day-two §1, §14)."""

from __future__ import annotations

import os
import resource
from typing import Any

import pytest
import torch

from scaleout.env.base import WorldSpec
from scaleout.errors import TopologyError
from scaleout.startup import (
    NCCL_DEFAULTS,
    hidden_gpus_warning,
    nccl_defaults,
    open_files_needed,
    raise_limits,
)

INF = resource.RLIM_INFINITY


class Limits:
    """resource's getrlimit/setrlimit over a dict (a process cannot lower then re-raise its own
    hard limit, so the real module cannot show a low hard limit)."""

    RLIMIT_NOFILE, RLIMIT_MEMLOCK, RLIM_INFINITY = (
        resource.RLIMIT_NOFILE,
        resource.RLIMIT_MEMLOCK,
        INF,
    )

    def __init__(self, nofile: tuple[int, int], memlock: tuple[int, int] = (INF, INF)) -> None:
        self.limits = {self.RLIMIT_NOFILE: nofile, self.RLIMIT_MEMLOCK: memlock}

    def getrlimit(self, which: int) -> tuple[int, int]:
        return self.limits[which]

    def setrlimit(self, which: int, value: tuple[int, int]) -> None:
        assert value[0] <= value[1] and (value[1] <= self.limits[which][1] or value[1] == INF)
        self.limits[which] = value


@pytest.mark.unit
def test_the_soft_open_file_limit_is_raised_to_the_hard_one() -> None:
    limits = Limits((1024, 1 << 20))
    got = raise_limits(2048, 256, "nccl", {}, limits)
    assert limits.limits[resource.RLIMIT_NOFILE] == (1 << 20, 1 << 20)
    assert got["nofile"] == 1 << 20


@pytest.mark.unit
def test_a_hard_open_file_limit_too_low_for_the_world_is_one_line() -> None:
    with pytest.raises(TopologyError) as err:
        raise_limits(2048, 256, "nccl", {}, Limits((1024, 1024)))
    text = str(err.value)
    assert "\n" not in text and "1024" in text and str(open_files_needed(2048, "nccl")) in text
    assert "2048 ranks" in text
    # the same limit is plenty for a small world, and gloo's own mesh counts
    raise_limits(8, 2, "gloo", {}, Limits((1024, 1024)))
    assert open_files_needed(300, "gloo") > open_files_needed(300, "nccl")


@pytest.mark.unit
def test_multi_node_nccl_needs_unlimited_locked_memory() -> None:
    with pytest.raises(TopologyError, match=r"ulimit -l.*65536"):
        raise_limits(16, 2, "nccl", {}, Limits((INF, INF), memlock=(65536, 65536)))
    raise_limits(16, 2, "nccl", {"NCCL_IB_DISABLE": "1"}, Limits((INF, INF), (65536, 65536)))
    raise_limits(8, 1, "nccl", {}, Limits((INF, INF), (65536, 65536)))  # NVLink only
    limits = Limits((INF, INF), memlock=(65536, INF))
    raise_limits(16, 2, "nccl", {}, limits)
    assert limits.limits[resource.RLIMIT_MEMLOCK] == (INF, INF)  # raised


@pytest.mark.unit
def test_the_nccl_environment_defaults_leave_a_users_value_alone() -> None:
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert nccl_defaults(env) == {
        k: v for k, v in NCCL_DEFAULTS.items() if k != "CUDA_DEVICE_ORDER"
    }
    assert env["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"
    fresh: dict[str, str] = {}
    nccl_defaults(fresh)
    assert fresh["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


class _Stop(Exception):
    pass


@pytest.mark.unit
@pytest.mark.parametrize("cuda", [True, False])
def test_init_passes_this_ranks_cuda_device_to_init_process_group(
    monkeypatch: pytest.MonkeyPatch, cuda: bool
) -> None:
    """CUDA is mocked (there is no GPU here): the device count, set_device and the rendezvous's
    init_process_group, which records its arguments and stops init there."""
    import scaleout.world as world_mod

    seen: dict[str, Any] = {}

    def fake_init(backend: str, **kwargs: Any) -> None:
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(world_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world_mod.dist, "init_process_group", fake_init)
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_DEVICE_ORDER"):
        monkeypatch.setenv(var, os.environ.get(var, "x"))  # restored after the test
    with pytest.raises(_Stop):
        world_mod.init(env={"SCALEOUT_DEVICE": "2"}, environment="single")
    if cuda:
        assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 2)
    else:
        assert seen["backend"] == "gloo" and "device_id" not in seen


@pytest.mark.unit
def test_the_object_group_of_a_nccl_world_connects_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    """World.cpu_group on a NCCL world (device mocked: no collective runs) builds its gloo group
    with lazy connections, not an eager world mesh; the switch is not left set for later
    groups (the training backend's)."""
    import scaleout.world as world_mod

    made: list[str | None] = []

    def new_group(**kwargs: Any) -> object:
        assert kwargs["backend"] == "gloo"
        made.append(os.environ.get(world_mod.GLOO_LAZY_INIT))
        return object()

    monkeypatch.setattr(world_mod.dist, "new_group", new_group)
    monkeypatch.delenv(world_mod.GLOO_LAZY_INIT, raising=False)
    spec = WorldSpec(0, 0, 0, 256, 8, 2048, "127.0.0.1", 1, "slurm")
    world = world_mod.World(spec, torch.device("cuda", 0), "nccl", (0,) * 2048)
    group = world.cpu_group
    assert world.cpu_group is group and made == ["1"]
    assert world_mod.GLOO_LAZY_INIT not in os.environ


def _shared(world, ask_rank: int) -> dict:
    from scaleout.errors import UserError
    from scaleout.store_share import broadcast_object, share

    calls = []

    def decide() -> str:
        calls.append(world.rank)
        return f"decided on {world.rank}"

    value = share(world, "probe", decide)
    head = broadcast_object(world, "head", {"path": "ckpt-3"} if world.rank == 0 else None)

    def refuse() -> None:
        raise UserError("data.path=/x: no shards")

    try:
        share(world, "refused", refuse, src=ask_rank)
        error = None
    except UserError as exc:
        error = str(exc)
    return {"value": value, "calls": calls, "head": head, "error": error}


@pytest.mark.multi_process
def test_a_store_share_is_decided_once_and_its_error_is_raised_everywhere() -> None:
    from tests.distutil import run_dist

    results = run_dist(_shared, 1, 2, args=(1,))
    assert [r["value"] for r in results] == ["decided on 0"] * 2
    assert [r["calls"] for r in results] == [[0], []]  # rank 1 never computed it
    assert [r["head"] for r in results] == [{"path": "ckpt-3"}] * 2
    assert [r["error"] for r in results] == ["data.path=/x: no shards"] * 2


@pytest.mark.unit
def test_a_task_that_sees_fewer_gpus_than_its_node_has_ranks_is_warned() -> None:
    text = hidden_gpus_warning(1, 8)
    assert text and "\n" not in text and "--gpus-per-node" in text and "8 ranks" in text
    assert hidden_gpus_warning(8, 8) is None and hidden_gpus_warning(0, 8) is None
