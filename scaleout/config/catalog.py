"""The shipped configs (configs/*.yaml) as a table: ``scaleout config list``.

Each row reads the file itself: its family (model.arch), its shape (launch.nnodes x
launch.nproc_per_node), its global batch and the first line of its leading comment, so a new
config appears with nothing to register. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from scaleout.config.load import CONFIG_DIR

DESCRIPTION_CHARS = 100  # one terminal line with the other columns wrapped below it


@dataclass(frozen=True)
class Entry:
    name: str
    family: str
    nodes: int
    gpus_per_node: int
    global_batch: int
    description: str


def describe(path: Path) -> Entry:
    """One config file's row (defaults as the schema's: 1 node x 1, batch 32, arch bert)."""
    text = path.read_text()
    tree = yaml.safe_load(text) or {}
    launch, train = tree.get("launch", {}), tree.get("train", {})
    first = next((ln for ln in text.splitlines() if ln.startswith("#")), "# (no description)")
    line = first.lstrip("#").strip()
    if len(line) > DESCRIPTION_CHARS:
        line = line[: DESCRIPTION_CHARS - 3].rstrip() + "..."
    return Entry(
        path.stem,
        tree.get("model", {}).get("arch", "bert"),
        int(launch.get("nnodes", 1)),
        int(launch.get("nproc_per_node", 1)),
        int(train.get("global_batch", 32)),
        line,
    )


def shipped(folder: Path = CONFIG_DIR) -> list[Entry]:
    """Every config in ``folder``: by family, then by size (GPUs), then by name."""
    entries = [describe(p) for p in folder.glob("*.yaml")]
    return sorted(entries, key=lambda e: (e.family, e.nodes * e.gpus_per_node, e.name))


def table_rows(entries: list[Entry]) -> list[list[str]]:
    return [
        [e.name, e.family, f"{e.nodes}x{e.gpus_per_node}", str(e.global_batch), e.description]
        for e in entries
    ]
