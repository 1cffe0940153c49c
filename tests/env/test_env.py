"""Every launcher environment, read from constructed variables, and the detection order.

The same readers are exercised for real under the local launcher (test_world.py), mpiexec
(test_mpi.py), srun (test_slurm.py) and horovodrun when installed (test_horovod.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scaleout.env import ENVIRONMENTS, detect_environment, detection_order
from scaleout.env.slurm import SlurmEnv
from scaleout.errors import UserError

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "x",
}
SLURM = {
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "3",
    "SLURM_NTASKS": "7",
    "SLURM_NNODES": "4",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_JOB_NODELIST": "gpu[001-003,007]",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "SCALEOUT_MPI_NODE_RANK": "1",
    "SCALEOUT_MPI_NUM_NODES": "2",
    "MASTER_ADDR": "h0",
    "MASTER_PORT": "1234",
}
MPICH = {
    "PMI_RANK": "2",
    "PMI_SIZE": "4",
    "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2",
    "SCALEOUT_MPI_NODE_RANK": "1",
    "SCALEOUT_MPI_NUM_NODES": "2",
    "MASTER_ADDR": "h0",
    "MASTER_PORT": "1",
}
HOROVOD = {
    "HOROVOD_RANK": "3",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "5",
}
LOCAL = {
    "SCALEOUT_RANK": "3",
    "SCALEOUT_LOCAL_RANK": "1",
    "SCALEOUT_NODE_RANK": "1",
    "SCALEOUT_NNODES": "2",
    "SCALEOUT_NPROC_PER_NODE": "2",
    "SCALEOUT_WORLD_SIZE": "4",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "7",
}


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


def _spec(env, explicit=None):
    reader = detect_environment(env, explicit)
    return reader.name, reader.read(env)


def _key(spec):
    return (
        spec.rank,
        spec.local_rank,
        spec.node_rank,
        spec.num_nodes,
        spec.local_size,
        spec.world_size,
    )


@pytest.mark.unit
def test_torchrun() -> None:
    name, s = _spec(TORCHRUN)
    assert (
        name == "torchrun"
        and _key(s) == (5, 1, 1, 2, 4, 8)
        and (s.master_addr, s.master_port) == ("10.0.0.1", 29500)
    )
    env = {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    assert _key(_spec(env)[1]) == (
        5,
        1,
        1,
        2,
        4,
        8,
    )  # node rank derived from RANK // LOCAL_WORLD_SIZE


@pytest.mark.unit
def test_slurm_uneven_tasks_and_nodelist() -> None:
    name, s = _spec(SLURM)
    assert name == "slurm"
    assert _key(s) == (6, 0, 3, 4, 1, 7)
    assert s.tasks_per_node == (2, 2, 2, 1)
    assert s.master_addr == "gpu001"  # first host of the nodelist
    assert s.master_port == SlurmEnv.port_for_job(4242)
    assert _spec({**SLURM, "MASTER_ADDR": "ib0", "MASTER_PORT": "999"})[1].master_port == 999
    # step variables win over the job's (a step on 2 of the job's 4 nodes)
    step = {
        **SLURM,
        "SLURM_PROCID": "2",
        "SLURM_NODEID": "1",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[003,007]",
    }
    s2 = _spec(step)[1]
    assert _key(s2) == (2, 0, 1, 2, 2, 4) and s2.master_addr == "gpu003"


@pytest.mark.unit
def test_slurm_batch_script_is_not_a_task() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert detect_environment(env).name == "single"


@pytest.mark.unit
def test_mpi_openmpi_and_mpich() -> None:
    assert _spec(OMPI)[0] == "mpi" and _key(_spec(OMPI)[1]) == (3, 1, 1, 2, 2, 4)
    assert _key(_spec(MPICH)[1]) == (2, 0, 1, 2, 2, 4)


# What each launcher really sets (seen on this machine: Slurm 22.05 + Debian libpmix 4.2, the Open
# MPI 5 wheel's mpiexec, both also inside an allocation; MPICH's Hydra from its documentation).
SRUN_PMIX = {  # srun --mpi=pmix (or MpiDefault=pmix): no size variable at all
    **SLURM,
    "PMIX_RANK": "6",
    "PMIX_NAMESPACE": "slurm.pmix.4242.0",
    "PMIX_SERVER_URI4": "pmix-server.19678;tcp4://127.0.0.1:42207",
    "PMIX_SECURITY_MODE": "native",
    "PMIX_VERSION": "4.2.2rc2",
}
SRUN_PMI2 = {**SLURM, "PMI_RANK": "6", "PMI_SIZE": "7", "PMI_FD": "11", "PMI_JOBID": "4242.0"}
OMPI5_MPIRUN = {  # Open MPI 5's mpirun: its PMIx server sets PMIX_RANK next to OMPI_COMM_WORLD_*
    **OMPI,
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_RANK": "3",
    "PMIX_NAMESPACE": "prterun-vm-21928@1",
    "PMIX_SERVER_URI4": "prterun-vm-21928@0.0;tcp4://127.0.0.1:35875",
}
# mpirun inside an allocation starts its daemons with srun: every rank inherits the daemon's srun
# task (SLURM_PROCID = the daemon's, SLURM_STEP_ID of the daemons' step)
DAEMON_STEP = {
    **SLURM,
    "SLURM_PROCID": "0",
    "SLURM_NODEID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}
# MPICH/Intel MPI mpiexec (Hydra): PMI_* plus MPI_LOCALRANKID/NRANKS
HYDRA = {**MPICH, "PMI_FD": "6"}


# (what started the process, its variables, the environment detected, the rank read or None: not
# readable without mpi4py)
PMI_CASES = [
    ("srun --mpi=none", SLURM, "slurm", 6),
    ("srun --mpi=pmix", SRUN_PMIX, "slurm", 6),
    ("srun --mpi=pmi2", SRUN_PMI2, "slurm", 6),
    ("srun --mpi=pmix, step variables", {**SRUN_PMIX, "SLURM_STEP_NUM_TASKS": "7"}, "slurm", 6),
    (
        "srun --mpi=pmi2, older Slurm's SLURM_STEPID",
        {**_without(SRUN_PMI2, "SLURM_STEP_ID"), "SLURM_STEPID": "0"},
        "slurm",
        6,
    ),
    ("Open MPI 5 mpirun", OMPI5_MPIRUN, "mpi", 3),
    ("Open MPI 5 mpirun inside an allocation", {**DAEMON_STEP, **OMPI5_MPIRUN}, "mpi", 3),
    (
        "Open MPI 5 mpirun from the batch script",
        {**_without(SLURM, "SLURM_STEP_ID"), **OMPI5_MPIRUN},
        "mpi",
        3,
    ),
    ("MPICH/Hydra mpiexec", HYDRA, "mpi", 2),
    ("MPICH/Hydra mpiexec inside an allocation", {**DAEMON_STEP, **HYDRA}, "mpi", 2),
    # a PMI launcher inside an srun task, whose values are not srun's (`srun -n1 mpiexec -n 4`)
    (
        "PMI_RANK/PMI_SIZE of a launcher inside an srun step",
        {**DAEMON_STEP, "SLURM_STEP_NUM_TASKS": "1", "PMI_RANK": "0", "PMI_SIZE": "4"},
        "mpi",
        None,
    ),
    (
        "PMIX_RANK of a launcher inside an srun step",
        {**SRUN_PMIX, "PMIX_RANK": "2"},
        "mpi",
        None,
    ),
    ("PMIX_RANK and an mpirun's size", {**SRUN_PMIX, "OMPI_COMM_WORLD_SIZE": "7"}, "mpi", None),
]


@pytest.mark.unit
@pytest.mark.parametrize(("case", "env", "want", "rank"), PMI_CASES, ids=[c[0] for c in PMI_CASES])
def test_srun_pmi_plugins_are_slurm_and_mpirun_is_mpi(case, env, want, rank) -> None:
    """srun's PMI plugins (--mpi=pmix/pmi2, or a cluster's MpiDefault) set PMIX_RANK or
    PMI_RANK/PMI_SIZE in every task: those tasks are Slurm ranks (they were read as MPI and died
    at init, "OMPI_COMM_WORLD_SIZE is not set", or hung in Open MPI's init). An mpirun/mpiexec,
    also inside an allocation, stays MPI."""
    reader = detect_environment(env)
    assert reader.name == want, case
    if rank is not None:
        spec = reader.read(env)
        assert spec.rank == rank and spec.launcher == want, case
        if want == "slurm":  # exactly what srun --mpi=none gives
            assert (
                _key(spec) == _key(_spec(SLURM)[1])
                and spec.master_port == _spec(SLURM)[1].master_port
            )


@pytest.mark.unit
def test_srun_pmi_ranks_log_and_read_as_slurm(monkeypatch) -> None:
    """The rank scaleout.log finds before any World exists is the one the slurm reader gives, and
    MPI ranks inside an allocation still read MPI's rank."""
    from scaleout.env import rank_variables
    from scaleout.log import _rank

    for env, rank in [(SRUN_PMIX, 6), (SRUN_PMI2, 6), ({**DAEMON_STEP, **OMPI5_MPIRUN}, 3)]:
        for k in rank_variables():
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert _rank() == rank == detect_environment(env).read(env).rank


@pytest.mark.unit
def test_horovod() -> None:
    name, s = _spec({**HOROVOD, **OMPI})  # horovodrun over MPI sets both: Horovod wins
    assert name == "horovod" and _key(s) == (3, 1, 1, 2, 2, 4)


@pytest.mark.unit
def test_local_launcher() -> None:
    name, s = _spec({**LOCAL, **TORCHRUN})  # the local launcher also sets torchrun's variables
    assert name == "local" and _key(s) == (3, 1, 1, 2, 2, 4) and s.tasks_per_node == (2, 2)


@pytest.mark.unit
def test_single_and_order() -> None:
    name, s = _spec({})
    assert name == "single" and _key(s) == (0, 0, 0, 1, 1, 1)
    assert detection_order() == ("local", "torchrun", "horovod", "mpi", "slurm", "single")
    # inside an allocation mpirun ranks see SLURM_* too: MPI wins over Slurm
    assert detect_environment({**SLURM, **OMPI}).name == "mpi"


@pytest.mark.unit
def test_explicit_choice_overrides_detection() -> None:
    env = {**SLURM, **TORCHRUN}
    assert detect_environment(env).name == "torchrun"
    assert detect_environment(env, "slurm").name == "slurm"
    assert detect_environment({**env, "SCALEOUT_ENV": "slurm"}).name == "slurm"
    with pytest.raises(UserError, match="launch.env='pbs'"):
        detect_environment(env, "pbs")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
        ({**TORCHRUN, "RANK": "9"}, "rank 9 not in [0, world_size=8)"),
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"},
            "SLURM_TASKS_PER_NODE is not set",
        ),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x3)"}, "describes 3 nodes, expected 4"),
        ({**SLURM, "SLURM_NTASKS": "9"}, "sums to 7, expected SLURM_NTASKS=9"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[001-"}, "unclosed"),
        ({**HOROVOD, "HOROVOD_LOCAL_RANK": "2"}, "local rank 2 not in [0, 2)"),
        ({k: v for k, v in LOCAL.items() if k != "SCALEOUT_NNODES"}, "SCALEOUT_NNODES is not set"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0: expected an integer >= 1"),
        (
            {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
            | {"LOCAL_WORLD_SIZE": "0"},
            "LOCAL_WORLD_SIZE=0: expected an integer >= 1",
        ),
        (
            {**TORCHRUN, "MASTER_PORT": "70000"},
            "MASTER_PORT=70000: expected a port from 1 to 65535",
        ),
        ({**SLURM, "MASTER_PORT": "-5"}, "MASTER_PORT=-5: expected a port from 1 to 65535"),
        ({**LOCAL, "MASTER_PORT": "0"}, "MASTER_PORT=0: expected a port from 1 to 65535"),
        (
            {**SLURM, "SLURM_TASKS_PER_NODE": "2(x99999999999)"},
            "describes at least 99999999999 nodes, expected 4",
        ),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x3"}, "unclosed '(x'"),
        ({**SLURM, "SLURM_JOB_NODELIST": "n[0-999999]b[0-9]"}, "more than 1000000 hosts"),
        (
            {**HOROVOD, "HOROVOD_GLOO_RENDEZVOUS_PORT": "99999"},
            "HOROVOD_GLOO_RENDEZVOUS_PORT=99999: expected a port",
        ),
    ],
)
def test_bad_variables_are_one_line_errors(env, needle) -> None:
    with pytest.raises(UserError) as exc:  # LaunchEnvError or NodelistError
        detect_environment(env).read(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.unit
def test_bad_variables_fail_fast() -> None:
    """A repeat count of 10^11 is refused before anything is expanded (it used to be a
    MemoryError)."""
    import time

    t0 = time.perf_counter()
    with pytest.raises(UserError):
        SlurmEnv().read({**SLURM, "SLURM_TASKS_PER_NODE": "2(x99999999999)"})
    with pytest.raises(UserError):
        SlurmEnv().read({**SLURM, "SLURM_JOB_NODELIST": "n[0-999999]b[0-9]"})
    assert time.perf_counter() - t0 < 2.0


# -- rendezvous ports and addresses
# ------------------------------------------------------------------


@pytest.mark.multi_process
def test_slurm_port_map_stays_below_the_real_ephemeral_range() -> None:
    """Real check: the kernel hands out ephemeral ports from ip_local_port_range (bind to port 0
    many times), and the job-id map never lands there, for every job id residue."""
    import socket

    from scaleout.env.slurm import ephemeral_port_low

    low = ephemeral_port_low()
    socks = []
    try:
        for _ in range(200):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        assert min(s.getsockname()[1] for s in socks) >= low  # the file means what the map assumes
    finally:
        for s in socks:
            s.close()
    ports = {SlurmEnv.port_for_job(j) for j in range(0, 100_000)}
    assert max(ports) < low and min(ports) >= 1024
    assert len(ports) == min(
        100_000, low - SlurmEnv.PORT_BASE
    )  # the whole span is used: no clustering
    assert SlurmEnv.port_for_job(17768) < low  # 15000 + 17768 was 32768, the range's first port


@pytest.mark.unit
def test_slurm_port_map_adapts_to_the_range() -> None:
    assert SlurmEnv.port_for_job(0, 32768) == 15000 and SlurmEnv.port_for_job(17767, 32768) == 32767
    assert SlurmEnv.port_for_job(17768, 32768) == 15000
    assert {SlurmEnv.port_for_job(j, 10000) for j in range(20000)} == set(
        range(1024, 10000)
    )  # a lowered range
    with pytest.raises(UserError, match="ephemeral port range starts at 1500"):
        SlurmEnv.port_for_job(1, 1500)
    s = _spec(SLURM)[1]
    assert s.master_port == SlurmEnv.port_for_job(4242)


def _resolver(table):
    return lambda host: table.get(host, [])


@pytest.mark.unit
def test_mpi_master_address_is_never_debians_127_0_1_1() -> None:
    """Debian's /etc/hosts maps the host name to 127.0.1.1. With ranks on two hosts, rank 0 must
    publish the address of the interface that routes to the other host (pure functions: no second
    host here)."""
    from scaleout.env.mpi import master_address

    table = {"node1": ["127.0.1.1"], "node2": ["10.0.0.2"]}
    toward = {"10.0.0.2": "10.0.0.1"}.get
    assert (
        master_address(["node1", "node2", "node2"], resolve_fn=_resolver(table), toward_fn=toward)
        == "10.0.0.1"
    )
    assert (
        master_address(["node1", "node1"], resolve_fn=_resolver(table), toward_fn=toward)
        == "127.0.0.1"
    )
    # the peer does not resolve here: an interface address, never the loopback one
    ifs = [("lo", "127.0.0.1", True), ("eth0", "10.0.0.1", False)]
    assert (
        master_address(
            ["node1", "nodeX"],
            resolve_fn=_resolver(table),
            toward_fn=toward,
            interfaces_fn=lambda: ifs,
        )
        == "10.0.0.1"
    )
    with pytest.raises(UserError, match="no non-loopback address found for host 'node1'"):
        master_address(
            ["node1", "nodeX"],
            resolve_fn=_resolver(table),
            toward_fn=toward,
            interfaces_fn=lambda: ifs[:1],
        )


@pytest.mark.unit
def test_reachable_address_real_sockets() -> None:
    """On this machine: the address toward one of its own non-loopback addresses is that address,
    and the loopback interface is found by its flag."""
    from scaleout.env.addr import (
        address_toward,
        interfaces,
        is_loopback,
        loopback_interface,
        reachable_address,
    )

    ifs = interfaces()
    assert (
        any(loop and addr == "127.0.0.1" for _, addr, loop in ifs)
        and loopback_interface() is not None
    )
    outside = [addr for _, addr, loop in ifs if addr and not loop]
    if not outside:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    assert address_toward(outside[0]) == outside[0]
    assert reachable_address([outside[0]]) == outside[0]
    assert not is_loopback(reachable_address(["no-such-host.invalid"]))
    assert (
        is_loopback("127.0.1.1") and is_loopback("::ffff:127.0.0.1") and not is_loopback("10.0.0.1")
    )


class _KV:
    """A stand-in for horovodrun's rendezvous HTTP store (horovod is not installed here): PUT
    stores the body under the path, GET returns it or 404, the behaviour scaleout.env.horovod_kv
    relies on."""

    def __enter__(self):
        import http.server
        import threading

        store = self.store = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PUT(self):
                store[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.end_headers()

            def do_GET(self):
                if self.path not in store:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(store[self.path])

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.unit
def test_horovod_publishes_rank0_address_and_port() -> None:
    """Rank 0 need not run on horovodrun's host: its own address travels with the port."""
    import threading

    from scaleout.env.horovod import HorovodEnv
    from scaleout.env.horovod_kv import exchange_master

    with _KV() as kv:
        kv_port = kv.server.server_address[1]
        got = {}
        t = threading.Thread(
            target=lambda: got.setdefault(1, exchange_master("127.0.0.1", kv_port, 1, timeout_s=30))
        )
        t.start()
        assert exchange_master("127.0.0.1", kv_port, 0, "10.9.8.7", 29400) == ("10.9.8.7", 29400)
        t.join(30)
        assert got[1] == ("10.9.8.7", 29400)
        # Through the reader: two nodes, rank 0 publishes a non-loopback address of its own host.
        env = {
            **{k: v for k, v in HOROVOD.items() if not k.startswith("MASTER_")},
            "HOROVOD_RANK": "0",
            "HOROVOD_LOCAL_RANK": "0",
            "HOROVOD_CROSS_RANK": "0",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(kv_port),
        }
        reader = HorovodEnv()
        addr, port = reader.rendezvous(reader.read(env))
        assert json_of(kv.store["/scaleout/master"]) == {"addr": addr, "port": port}
        from scaleout.env.addr import is_loopback

        assert not is_loopback(addr) and 1 <= port <= 65535
        kv.store["/scaleout/master"] = b"garbage"
        with pytest.raises(UserError, match="holds b'garbage', expected"):
            exchange_master("127.0.0.1", kv_port, 1, timeout_s=5)


def json_of(body: bytes):
    import json

    return json.loads(body)


@pytest.mark.unit
def test_submit_local_jobs_get_distinct_free_ports() -> None:
    """Before: 15000 + byte-sum(job id) * 7919 % 20000 took 45 values over 5-digit pids. Now
    every job of an --array gets its own port, free on this host at submission."""
    import socket

    from scaleout.launchers.submit import SubmitSpec, rank_mains

    spec = SubmitSpec(
        argv=["train", "c.yaml"],
        gpus_per_node=2,
        cluster="local",
        array={"optim.lr": [str(i) for i in range(16)]},
    )
    mains = rank_mains(spec)
    ports = [m.master_port for m in mains]
    assert len(set(ports)) == 16 and [m.argv[-1] for m in mains] == [
        f"optim.lr={i}" for i in range(16)
    ]
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free indeed
    slurm = SubmitSpec(argv=["train", "c.yaml"], cluster="slurm")
    if shutil_which("sbatch"):
        assert [m.master_port for m in rank_mains(slurm)] == [
            None
        ]  # Slurm: derived from the job id


def shutil_which(name: str):
    import shutil

    return shutil.which(name)


@pytest.mark.unit
def test_forced_slurm_outside_srun_is_refused() -> None:
    """launch.env=slurm in the batch shell (no srun): one line, instead of waiting for
    SLURM_NTASKS peers."""
    from scaleout.errors import LaunchEnvError

    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    reader = detect_environment(env, "slurm")
    with pytest.raises(
        LaunchEnvError,
        match=r"^slurm environment: SLURM_STEP_ID is not set, so srun did not start",
    ):
        reader.read(env)
    assert reader.read({**env, "SLURM_STEPID": "3"}).rank == 6  # older Slurm spells it STEPID


@pytest.mark.unit
def test_local_variables_written_and_read_through_one_mapping(monkeypatch) -> None:
    """The variables scaleout's launchers write (env.base.local_rank_env) are exactly what
    LocalEnv reads, torchrun's reader sees the same rank, and scaleout.log finds it before any
    World exists."""
    from scaleout.env import ENVIRONMENTS, detect_environment, rank_variables
    from scaleout.env.base import LOCAL_VARS, free_ports, local_rank_env
    from scaleout.log import _rank

    env = local_rank_env(3, nnodes=2, nproc=2, addr="10.0.0.1", port=29500)
    assert set(LOCAL_VARS.values()) <= set(env)
    assert detect_environment(env).name == "local"
    s = ENVIRONMENTS.get("local").read(env)
    assert (s.rank, s.local_rank, s.node_rank, s.num_nodes, s.local_size, s.world_size) == (
        3,
        1,
        1,
        2,
        2,
        4,
    )
    assert (s.master_addr, s.master_port, s.launcher, s.tasks_per_node) == (
        "10.0.0.1",
        29500,
        "local",
        (2, 2),
    )
    t = ENVIRONMENTS.get("torchrun").read(env)
    assert (t.rank, t.local_rank, t.node_rank, t.world_size) == (3, 1, 1, 4)
    rank_vars = rank_variables()
    assert rank_vars[0] == LOCAL_VARS["rank"] and "SLURM_PROCID" in rank_vars
    for k in rank_vars:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv(
        "OMPI_COMM_WORLD_RANK", "2"
    )  # mpirun inside an allocation: MPI's rank wins, as detection
    assert _rank() == 2
    ports = free_ports(4)
    assert len(set(ports)) == 4 and all(1 <= p <= 65535 for p in ports)


@pytest.mark.unit
def test_readme_detection_table_matches_the_registry() -> None:
    """The README's detection table lists the registered environments in priority order (one
    order, one place: each environment's ``priority``)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([a-z0-9_]+)` \|", readme, flags=re.MULTILINE)
    assert [name for _, name in rows] == list(detection_order())
    assert [int(k) for k, _ in rows] == list(range(1, len(rows) + 1))
    text = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    start = text.index("## A launcher environment")
    guide = text[start : text.index("\n## ", start + 1)]
    listed = dict(re.findall(r"`([a-z]+)` (\d+)", " ".join(guide.split())))
    assert listed == {n: str(ENVIRONMENTS.get(n).priority) for n in detection_order()}


@pytest.mark.unit
def test_a_taken_name_or_priority_is_refused() -> None:
    from scaleout.env import ENVIRONMENTS, Environment, register
    from scaleout.registry import RegistryError

    class Twin(Environment):
        name = "local"
        priority = 999

    class SamePriority(Environment):
        name = "same-priority"
        priority = ENVIRONMENTS.get("slurm").priority

    with pytest.raises(RegistryError, match="'local' is already registered"):
        register(Twin)
    with pytest.raises(RegistryError, match="priority 50 is already 'slurm'"):
        register(SamePriority)
    assert "same-priority" not in ENVIRONMENTS


@pytest.mark.unit
@pytest.mark.parametrize("name", [n for n in detection_order() if n != "single"])
def test_a_forced_environment_without_its_variables_is_one_line(name: str) -> None:
    """launch.env=<name> (or --env) where that launcher did not start the process: a one-line
    error naming a missing variable, for every registered environment (the split into files once
    let mpi raise StopIteration here)."""
    with pytest.raises(UserError, match=rf"^{name} environment: \S+ is not set"):
        detect_environment({}, name).read({})
