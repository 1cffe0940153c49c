import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real local Slurm cluster (launchers/slurm_local): started if not running, stopped at the end of
    the session if this session started it (tests/slurmutil.py)."""
    from tests import slurmutil

    yield from slurmutil.cluster_session()
