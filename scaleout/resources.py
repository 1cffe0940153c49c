"""Files shipped inside the package (configs, Slurm templates, data), found wherever scaleout is
installed.

A checkout (``PYTHONPATH=$PWD``), an editable install and a wheel all answer through
``importlib.resources``; configs/ and launchers/ stay top-level folders of the repository and are
reached as ``scaleout/configs`` and ``scaleout/launchers`` (symlinks in the checkout, real folders
in a wheel).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def package_path(package: str, *parts: str) -> Path:
    """``package_path("scaleout", "configs")`` -> the folder on disk (scaleout is never run from
    a zip)."""
    node = importlib.resources.files(package)
    for part in parts:
        node = node / part
    return Path(str(node))
