"""One rank's start-up, counted (run by ``scaleout launch`` for tests/test_startup_scale.py).

The real start-up path of a run, not a training run: ``scaleout.init()`` (rendezvous, World), the
intra- and inter-node groups, the rank-side preflight (``share(check_input_files)``), the initial
checkpoint load (``Checkpointer.restore``: rank 0 chooses and verifies, the others follow), and the
object group a NCCL world would make for DCP (``World.cpu_group``). Per rank it records:

- sockets (``/proc/self/fd``) after init (the training backend's world group: on gloo a full mesh
  by nature), after the groups (the backend's own subgroups) and at the end;
- bytes on this rank's TCPStore connections (the kernel's ``TCP_INFO`` counters of every socket to
  the master port: real traffic, no wrapper), and on rank 0 the bytes its store served;
- file-system calls from just before init to the end: ``open``/``os.scandir``/``os.listdir``
  (audit events) and ``os.stat``/``os.lstat`` (counted at the call).

usage: startup_probe.py OUT_DIR CKPT_DIR DATA_DIR INIT_CKPT
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from pathlib import Path

import torch

import scaleout
from scaleout.checkpoint import Checkpointer
from scaleout.config import load_config
from scaleout.train.inputs import check_input_files
from scaleout.world import World

TCP_INFO_BYTES = 232  # struct tcp_info up to tcpi_bytes_received (Linux >= 4.1)
RECEIVED, SENT = 128, 200  # offsets of tcpi_bytes_received / tcpi_bytes_sent (Linux >= 4.19)


def sockets() -> list[int]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                fds.append(int(fd))
        except OSError:
            pass
    return fds


def store_bytes(port: int) -> tuple[int, int]:
    """(bytes on this rank's connections to the store, bytes the store here served)."""
    mine = served = 0
    for fd in sockets():
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            try:
                peer, local = s.getpeername()[1], s.getsockname()[1]
            except OSError:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
            (got,), (sent,) = (
                struct.unpack_from("Q", info, RECEIVED),
                struct.unpack_from("Q", info, SENT),
            )
            if peer == port:
                mine += sent + got
            elif local == port:
                served += sent + got
    return mine, served


class FsCalls:
    def __init__(self) -> None:
        self.count = 0
        self.on = False
        sys.addaudithook(self.audit)
        for name in ("stat", "lstat"):
            real = getattr(os, name)

            def counted(*a, _real=real, **k):
                if self.on:
                    self.count += 1
                return _real(*a, **k)

            setattr(os, name, counted)

    def audit(self, event: str, args: tuple) -> None:
        if self.on and event in ("open", "os.scandir", "os.listdir"):
            self.count += 1


def mark(fs: FsCalls, port: int) -> tuple[int, int, int]:
    """Sockets and store bytes now (the probe's own /proc reads are not counted as start-up's)."""
    on, fs.on = fs.on, False
    try:
        return (len(sockets()), *store_bytes(port))
    finally:
        fs.on = on


def main() -> None:
    out, ckpt, data, init_ckpt = sys.argv[1:5]
    fs = FsCalls()
    port = int(os.environ["MASTER_PORT"])
    fs.on = True
    world = scaleout.init()
    marks = {"init": mark(fs, port)}
    world.intra, world.inter  # noqa: B018 -- the training backend's subgroups
    marks["groups"] = mark(fs, port)
    cfg = load_config(
        "configs/bert_tiny_cpu.yaml",
        ["data.source=wikipedia", f"data.path={data}", f"model.init_checkpoint={init_ckpt}"],
    )
    try:
        from scaleout.store_share import share
    except ImportError:  # the base commit of issue 41: every rank sniffed (before init)
        check_input_files(cfg)
    else:
        share(world, "input-files", lambda: check_input_files(cfg))  # the rank-side preflight
    marks["preflight"] = mark(fs, port)
    found = Checkpointer(ckpt, rank=world.rank).restore(world)
    assert found is not None and torch.equal(found[0]["model"]["w"], torch.arange(4.0))
    marks["restore"] = mark(fs, port)
    # the object group a NCCL world makes for DCP: no GPU here, the World only claims a CUDA
    # device so that cpu_group takes the NCCL-world branch; no CUDA call is made
    nccl_like = World(world.spec, torch.device("cuda", 0), "nccl", world.node_of, world.timeout_s)
    nccl_like.cpu_group  # noqa: B018 -- creation is what costs
    marks["object_group"] = mark(fs, port)
    world.barrier()
    fs.on = False
    marks["end"] = mark(fs, port)
    record = {"rank": world.rank, "world": world.world_size, "fs_calls": fs.count, "marks": marks}
    Path(out, f"rank{world.rank}.json").write_text(json.dumps(record))
    world.close()


if __name__ == "__main__":
    main()
