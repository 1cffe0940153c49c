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


def shared_file(relative: str):
    """A file of ../shared (beside the checkout, as on CI), else /work/shared (the dev machine's copy)."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "shared" / relative
    return here if here.is_file() else Path("/work/shared") / relative


WIKI_HIST = shared_file("data/wikipedia_seqlen_hist_512.txt")
