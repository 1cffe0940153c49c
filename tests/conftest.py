import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402

from tests.xdist_safe import pytest_xdist_make_scheduler  # noqa: E402, F401 -- the hook

TIERS = ("unit", "multi_process", "full_system")  # pyproject.toml [tool.pytest.ini_options] markers
SYSTEM = (
    "slurm",
    "mpi",
    "netns",
    "horovod",
)  # need the real thing: a full_system test by definition
# The suite runs on every core (pytest-xdist, pyproject addopts): these share machine-wide state --
# the one local Slurm cluster and /etc/hosts, the list of network namespaces, mpirun's and Horovod's
# rendezvous, a timing fit on the emulated links -- so they run in one group, on one worker, one
# after another, while the other workers take the rest (much of the group's time is waiting for
# Slurm). `-n 0` runs everything here.
SERIAL_FILES = {
    "test_netns.py",
    "test_sim_calibrate.py",
    "test_slurm.py",
    "test_preempt_slurm.py",
    "test_spares_slurm.py",
    "test_sweep.py",
    "test_submit_options.py",
    "test_slurm_local_safety.py",
    "test_mpi.py",
    "test_any_launcher.py",
}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``pytest -m unit`` does not even import a test file without a unit test: importing them
    (torch extensions, hypothesis, transformers) is most of the time the inner loop would
    otherwise spend collecting."""
    if (
        config.getoption("markexpr") == "unit"
        and collection_path.name.startswith("test_")
        and collection_path.suffix == ".py"
    ):
        return "mark.unit" not in collection_path.read_text()
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test gets exactly one tier (slurm/mpi/netns/horovod tests default to full_system),
    the tests of machine-wide state one xdist group, and a ``gpu`` test is skipped, with the
    reason, where this machine has fewer CUDA devices than it needs."""
    untiered = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if not tiers and any(item.get_closest_marker(m) for m in SYSTEM):
            item.add_marker("full_system")
        elif len(tiers) != 1:
            untiered.append(f"{item.nodeid}: {sorted(tiers) or 'no tier'}")
        if item.path.name in SERIAL_FILES or any(item.get_closest_marker(m) for m in SYSTEM):
            item.add_marker(pytest.mark.xdist_group("machine"))
        gpu = item.get_closest_marker("gpu")
        if gpu is not None:
            need = gpu.kwargs.get("devices", gpu.args[0] if gpu.args else 1)
            have = _cuda_devices()
            if have < need:
                why = gpu.kwargs.get("reason", "")
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs {need} CUDA device(s), this machine has {have}"
                        + (f" ({why})" if why else "")
                    )
                )
    if untiered:
        raise pytest.UsageError(
            "tests need exactly one tier marker ("
            + ", ".join(TIERS)
            + "; see pyproject.toml):\n  "
            + "\n  ".join(untiered)
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """run_dist's process pools end with the session. Its atexit hook is not enough: a
    pytest-xdist worker leaves with os._exit, which skips atexit -- and multiprocessing's reaping
    of daemonic children with it -- so every pool of every worker would outlive the suite (found
    as orphans after the first parallel run)."""
    for name in ("tests.distutil", "distutil"):  # imported under both names by different test files
        mod = sys.modules.get(name)
        if mod is not None:
            mod._shutdown()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real local Slurm cluster (launchers/slurm_local): started if not running, stopped at
    the end of the session if this session started it (tests/slurmutil.py)."""
    from tests import slurmutil

    yield from slurmutil.cluster_session()


# The Wikipedia-512 sequence-length histogram ships with scaleout (package data, the same file as
# ../shared/data/): the tests that need it always run, never skip on a missing copy beside the
# checkout.
WIKI_HIST = Path(ROOT) / "scaleout" / "data" / "wikipedia_seqlen_hist_512.txt"
