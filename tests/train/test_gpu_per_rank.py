"""One GPU per rank, always (issue 26 item 2): scaleout.init on a GPU host, driven on CPU.

No GPU can exist on this machine, so CUDA is a mock: ``torch.cuda.is_available``/``device_count``/
``set_device``/``get_device_properties`` are patched, and so is the part of ``torch.distributed``
that would meet the other ranks (``init_process_group`` does nothing, the rendezvous store is one
in-process ``HashStore`` shared by the simulated ranks, ``_observe_topology`` -- the first NCCL
collective -- is not reached for real). What runs for real: the variables the real local launcher
writes for each rank (``launchers.local.rank_env``) or Slurm's, the environment reader, and
``scaleout.init``'s choice of device and its check that no two ranks share one, which happens before
NCCL would see them ("Duplicate GPU detected").
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import scaleout.world as world_mod
from scaleout.errors import TopologyError
from scaleout.launchers.local import rank_env


class FakeHost:
    """The GPUs of the host the next simulated rank runs on, and what every rank did with them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
        self.gpus = gpus
        self.host = "gpu-node-0"
        self.per_task = (
            False  # Slurm --gpus-per-task=1: each task's CUDA_VISIBLE_DEVICES is its own GPU
        )
        self.rank = 0
        self.set_devices: list[torch.device] = []
        self.store = dist.HashStore()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if self.per_task else self.gpus)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_devices.append)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self._props)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
        monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: self.store)
        monkeypatch.setattr(world_mod, "_observe_topology", lambda spec: (0,) * spec.world_size)
        monkeypatch.setattr(world_mod, "nccl_error_handling", lambda env: None)
        # the simulated hosts' resource limits are not this machine's (scaleout/startup.py)
        monkeypatch.setattr(world_mod, "raise_limits", lambda *a, **k: {})
        # nor do their host names resolve here (the rendezvous check, scaleout/env/addr.py)
        monkeypatch.setattr(world_mod, "require_resolvable", lambda *a, **k: None)
        monkeypatch.setattr(world_mod.atexit, "register", lambda fn: None)

    def _props(self, device: torch.device) -> SimpleNamespace:
        physical = self.rank % self.gpus if self.per_task else device.index
        return SimpleNamespace(uuid=f"{self.host}-gpu{physical}")

    def init(self, env: dict[str, str], host: str | None = None) -> torch.device:
        self.host = host or self.host
        self.rank = int(env.get("SCALEOUT_RANK", env.get("SLURM_PROCID", "0")))
        return world_mod.init(env=env, backend="auto", timeout_s=5.0).device


def local_envs(nnodes: int, nproc: int) -> list[dict[str, str]]:
    return [rank_env({}, r, nnodes, nproc, "127.0.0.1", 29500) for r in range(nnodes * nproc)]


def slurm_env(rank: int, nnodes: int, per_node: int) -> dict[str, str]:
    node, local = divmod(rank, per_node)
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": str(nnodes),
        "SLURM_NTASKS": str(nnodes * per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})",
        "SLURM_JOB_NODELIST": f"gpu-node-[0-{nnodes - 1}]" if nnodes > 1 else "gpu-node-0",
        "MASTER_PORT": "29500",
    }


@pytest.mark.unit
@pytest.mark.parametrize("nnodes,nproc", [(2, 2), (2, 1), (2, 4)])
def test_emulated_nodes_on_one_host_get_distinct_gpus(
    monkeypatch: pytest.MonkeyPatch, nnodes: int, nproc: int
) -> None:
    """`scaleout launch --nnodes 2 --nproc-per-node G` on a host with 2G GPUs: every rank its own
    GPU (today: local_rank restarts at 0 on each emulated node, so ranks 0 and G both take
    cuda:0)."""
    fake = FakeHost(monkeypatch, gpus=nnodes * nproc)
    devices = [fake.init(env) for env in local_envs(nnodes, nproc)]
    assert devices == [torch.device("cuda", i) for i in range(nnodes * nproc)]
    assert fake.set_devices == devices


@pytest.mark.unit
def test_more_local_ranks_than_gpus_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 ranks of a local launch on a 4-GPU host: the fifth is refused in one line naming it and the
    visible devices, before NCCL (today: it silently takes cuda:0, shared with rank 0)."""
    fake = FakeHost(monkeypatch, gpus=4)
    envs = local_envs(1, 5)
    for env in envs[:4]:
        fake.init(env)
    with pytest.raises(TopologyError) as err:
        fake.init(envs[4])
    msg = str(err.value)
    assert "\n" not in msg and "rank 4" in msg and "SCALEOUT_DEVICE=4" in msg, msg
    assert "4 CUDA device(s)" in msg and "share a GPU" in msg, msg


@pytest.mark.unit
def test_two_ranks_on_one_gpu_refused_before_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm (no SCALEOUT_DEVICE), 5 tasks on one node with 4 GPUs visible to each: local rank 4
    maps onto cuda:0 again; the store check names both ranks and the GPU before any NCCL
    collective."""
    fake = FakeHost(monkeypatch, gpus=4)
    for rank in range(4):
        fake.init(slurm_env(rank, 1, 5))
    with pytest.raises(TopologyError) as err:
        fake.init(slurm_env(4, 1, 5))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ranks 0 and 4 both use cuda:0"), msg
    assert "gpu-node-0-gpu0" in msg, msg


@pytest.mark.unit
def test_slurm_real_nodes_use_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real nodes under Slurm: cuda:SLURM_LOCALID on each node, as before; the same index on two
    hosts is two different GPUs, so nothing is refused."""
    fake = FakeHost(monkeypatch, gpus=4)
    devices = [fake.init(slurm_env(rank, 2, 4), host=f"gpu-node-{rank // 4}") for rank in range(8)]
    assert devices == [torch.device("cuda", r % 4) for r in range(8)]


@pytest.mark.unit
def test_slurm_gpus_per_task_each_rank_on_its_own_cuda0(monkeypatch: pytest.MonkeyPatch) -> None:
    """`srun --gpus-per-task=1`: each task sees one GPU (its own CUDA_VISIBLE_DEVICES), so every
    rank is cuda:0 of its own set -- four different GPUs, not a shared one."""
    fake = FakeHost(monkeypatch, gpus=4)
    fake.per_task = True
    devices = [fake.init(slurm_env(rank, 1, 4)) for rank in range(4)]
    assert devices == [torch.device("cuda", 0)] * 4


@pytest.mark.unit
def test_device_index_refuses_a_bad_value() -> None:
    spec = SimpleNamespace(rank=0, local_rank=0, world_size=1)
    with pytest.raises(TopologyError, match="SCALEOUT_DEVICE='x'"):
        world_mod.device_index(spec, {"SCALEOUT_DEVICE": "x"}, 4)  # type: ignore[arg-type]
