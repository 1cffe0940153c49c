import os
import sys
from pathlib import Path

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


# The Wikipedia-512 sequence-length histogram ships with scaleout (package data, the same file as
# ../shared/data/): the tests that need it always run, never skip on a missing copy beside the checkout.
WIKI_HIST = Path(ROOT) / "scaleout" / "data" / "wikipedia_seqlen_hist_512.txt"
