"""Sharded optimizer state in ``torch.distributed.checkpoint`` (DCP): each rank writes and reads
only its part.

The state comes as *pieces*: ``{key: (tensor, offset, numel)}``, elements [offset, offset + len) of
one parameter's flattened state (``ShardedLAMB.sharded_state``). DCP stores each key as a 1-D tensor
of ``numel`` elements made of the chunks the ranks wrote (``ChunkStorageMetadata``; rank r writes
``__r_0.distcp``), so a load with another world size or bucket layout asks for its own ranges and
DCP reads the overlapping parts of the saved chunks: resharding. The planners are DCP's defaults
told where each piece sits (a plain tensor in a DCP state dict would mean "replicated, stored once,
loaded whole"; ShardedTensor, the older way to say "chunk", is deprecated in torch 2.13 and DTensor
only knows even splits).

Integrity, as for the replicated file: rank 0 records the sha256 of the ``.metadata`` file and every
rank the sha256 and size of the files it wrote; a reader verifies ``.metadata`` before DCP unpickles
it and every data file before reading from it. A failure on any rank raises on every rank (DCP
gathers them) and is re-raised here as one line naming the rank.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from scaleout.errors import ConfigError, UserError

if TYPE_CHECKING:
    from scaleout.world import World

METADATA = ".metadata"


class CorruptShards(UserError):
    """A sharded checkpoint whose files are missing, short, or do not match their recorded
    sha256."""


class PieceLike(Protocol):
    tensor: torch.Tensor
    offset: int
    numel: int


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _written(pieces: dict[str, PieceLike]) -> dict[str, PieceLike]:
    """The pieces this rank writes: not those marked ``replica`` (copies another rank writes:
    ShardedLAMB with optim.shard=node), so that every element is stored once (DCP refuses
    overlapping chunks); a load still reads into every piece."""
    return {k: p for k, p in pieces.items() if not getattr(p, "replica", False)}


def _chunk(p: PieceLike) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(
        offsets=torch.Size([p.offset]), sizes=torch.Size([p.tensor.numel()])
    )


class _SavePlanner(dcp.DefaultSavePlanner):
    def __init__(self, pieces: dict[str, PieceLike]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(
            [
                WriteItem(
                    index=MetadataIndex(key, torch.Size([p.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=_chunk(p),
                        properties=TensorProperties.create_from_tensor(p.tensor),
                        size=torch.Size([p.numel]),
                    ),
                )
                for key, p in self.pieces.items()
                if p.tensor.numel()
            ]
        )
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        # the state dict DCP planned with: the pieces themselves, or async_save's staged copy
        return self.state_dict[write_item.index.fqn].detach()


class _LoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self, pieces: dict[str, PieceLike]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, p in self.pieces.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (p.numel,):
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else md
                raise ConfigError(
                    f"sharded checkpoint has no {p.numel}-element state {key!r} (found {got}): "
                    "the model differs from the one that saved it"
                )
            if p.tensor.numel():
                items += create_read_items_for_chunk_list(key, md, [_chunk(p)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[index.fqn].tensor  # loaded in place: no copy of the state is ever held


class _VerifiedReader(dcp.FileSystemReader):
    """FileSystemReader that checks ``.metadata`` (before unpickling it) and each data file it
    reads from."""

    def __init__(self, path: Path, record: dict[str, Any]):
        super().__init__(path)
        self.record = record

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if (
            kwargs.get("rank") is not None
        ):  # DCP's fallback to per-rank metadata: never written here
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        meta = Path(self.path) / METADATA
        if sha256_file(meta) != self.record["metadata_sha256"]:
            raise CorruptShards(f"{meta}: sha256 mismatch")
        return super().read_metadata()

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        for name in sorted({self.storage_data[r.storage_index].relative_path for r in plan.items}):
            size, digest = self.record["files"].get(name, (None, None))
            if digest is None or sha256_file(Path(self.path) / name) != digest:
                raise CorruptShards(f"{Path(self.path) / name}: sha256 mismatch or not recorded")
        return super().read_data(plan, planner)


def _one_line(e: BaseException, directory: Path, what: str) -> UserError:
    failures = getattr(e, "failures", None)
    if not failures:
        return UserError(f"{what} {directory}: {type(e).__name__}: {e}")
    rank = min(failures)
    exc = failures[rank][0]
    more = f" (and ranks {sorted(failures)[1:]})" if len(failures) > 1 else ""
    return UserError(
        f"rank {rank}{more} cannot {what} {directory}: {type(exc).__name__}: {exc}".replace(
            "\n", " "
        )
    )


def save_pieces(
    pieces: dict[str, PieceLike], directory: Path, world: World, group: Any = None
) -> dict[str, Any] | None:
    """Every rank writes its pieces under ``directory`` (collective). Returns, on rank 0, the
    record to keep in the replicated file: {"dir", "metadata_sha256", "files": {name: (bytes,
    sha256)}}; None elsewhere. ``group``: where DCP's plans and the digests travel (a CPU group:
    DCP gathers every rank's plan to rank 0 and scatters them back)."""
    pieces = _written(pieces)
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(
        directory, single_file_per_rank=True, sync_files=True, thread_count=1
    )
    try:
        dcp.save(
            {k: p.tensor for k, p in pieces.items()},
            storage_writer=writer,
            planner=_SavePlanner(pieces),
            process_group=group,
        )
    except dcp.CheckpointException as e:
        raise _one_line(e, directory, "write the sharded checkpoint") from None
    return _record(directory, world, group)


def _record(directory: Path, world: World | None, group: Any) -> dict[str, Any] | None:
    """This rank's files' sizes and digests, gathered to rank 0 (on ``group``): the record rank 0
    keeps in the replicated file; None elsewhere."""
    rank = world.rank if world is not None else 0
    mine = {
        f.name: (f.stat().st_size, sha256_file(f))
        for f in sorted(directory.glob(f"__{rank}_*.distcp"))
    }
    files: list[Any] = [mine]
    if world is not None and world.world_size > 1:  # a few bytes per rank, to rank 0 only
        files = [None] * world.world_size if rank == 0 else None
        dist.gather_object(mine, files, dst=0, group=group)
    if rank != 0:
        return None
    merged = {name: entry for per_rank in files for name, entry in per_rank.items()}
    return {
        "dir": directory.name,
        "metadata_sha256": sha256_file(directory / METADATA),
        "files": merged,
    }


class PendingShards:
    """A sharded save under way (:func:`async_save_pieces`): :meth:`result` waits for this rank's
    files (DCP's thread), then gathers the digests to rank 0 (on the save's own group) and returns
    the record as :func:`save_pieces` does. Called from the checkpointer's background thread."""

    def __init__(self, upload: Any, directory: Path, world: World | None, group: Any):
        self.upload, self.directory, self.world, self.group = upload, directory, world, group

    def result(self) -> dict[str, Any] | None:
        try:
            self.upload.result()
        except dcp.CheckpointException as e:
            raise _one_line(e, self.directory, "write the sharded checkpoint") from None
        return _record(self.directory, self.world, self.group)


def async_save_pieces(
    pieces: dict[str, PieceLike], directory: Path, world: World | None, group: Any = None
) -> PendingShards:
    """:func:`save_pieces` through ``dcp.async_save``: DCP copies the pieces to host memory here
    (the stall) and writes them in its own thread, coordinating on ``group`` (a gloo group used by
    nothing else: those collectives run while the training's own run). Collective (the staging
    and the plan exchange start here on every rank)."""
    pieces = _written(pieces)
    directory.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(
        directory, single_file_per_rank=True, sync_files=True, thread_count=1
    )
    try:
        upload = dcp.async_save(
            {k: p.tensor for k, p in pieces.items()},
            storage_writer=writer,
            planner=_SavePlanner(pieces),
            process_group=group,
        )
    except dcp.CheckpointException as e:
        raise _one_line(e, directory, "write the sharded checkpoint") from None
    return PendingShards(upload, directory, world, group)


def check_shards(root: Path, record: dict[str, Any]) -> None:
    """Rank 0's completeness check before choosing a checkpoint: the directory, a matching
    ``.metadata`` and every recorded file at its recorded size (stat only: the data files are
    verified by whoever reads them)."""
    directory = root / record["dir"]
    meta = directory / METADATA
    if not meta.is_file() or sha256_file(meta) != record["metadata_sha256"]:
        raise CorruptShards(f"{directory}: {METADATA} missing or sha256 mismatch")
    for name, (size, _) in record["files"].items():
        f = directory / name
        if not f.is_file() or f.stat().st_size != size:
            raise CorruptShards(f"{f}: missing or not {size} bytes")


def load_pieces(
    pieces: dict[str, PieceLike], root: Path, record: dict[str, Any], group: Any = None
) -> None:
    """Every rank reads its pieces (in place) from the checkpoint ``record`` describes
    (collective, DCP's coordination on ``group``); any rank's failure is a one-line UserError
    naming it, raised on every rank."""
    directory = root / record["dir"]
    try:
        dcp.load(
            {k: p.tensor for k, p in pieces.items()},
            storage_reader=_VerifiedReader(directory, record),
            planner=_LoadPlanner(pieces),
            process_group=group,
        )
    except dcp.CheckpointException as e:
        raise _one_line(e, directory, "read the sharded checkpoint") from None


def remove_tree(path: Path) -> None:
    """Delete a shard directory (files, then the directory); missing is fine."""
    if not path.is_dir():
        return
    for f in path.iterdir():
        f.unlink(missing_ok=True)
    try:
        os.rmdir(path)
    except OSError:
        pass
