"""scaleout data stage: copy a data directory onto node-local disk, once per node."""

from __future__ import annotations

import argparse
import socket

NAME = "stage"
# A data tool: `scaleout data stage`.
GROUP = "data"
HELP = "copy a data directory to node-local disk, once per node (incremental, index kept)"
DESCRIPTION = """\
scaleout data stage SRC DEST

Copies SRC (a data.path: MLPerf BERT shards with train/ and eval/, image shards, ...) into DEST on
this node's own disk, then train with data.path=DEST. Once per node: ranks of the same node that
call it together wait on a lock and copy nothing twice; a file whose size and mtime match is kept,
so a requeued job restages at once. Mtimes are kept, so the shard index built on SRC by 'scaleout
data index' is reused on DEST. Free space is checked before anything is copied. Run it in the job,
one task per node, before the training step (docs/mlperf-data.md).

examples:
  srun --ntasks-per-node=1 scaleout data stage /lustre/mlperf/bert/data /raid/scratch/bert
  scaleout data stage /shared/imagenet-shards /local_scratch/imagenet-shards
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the data directory to copy (shared file system)")
    p.add_argument("dest", help="where on this node's disk (created if missing)")


def run(args: argparse.Namespace) -> int:
    from scaleout.data.stage import stage

    r = stage(args.src, args.dest)
    print(
        f"{socket.gethostname()}: {args.src} -> {args.dest}: copied {r.copied} files "
        f"({r.bytes_copied / 2**30:.2f} GiB) in {r.seconds:.1f} s, {r.kept} already there"
    )
    return 0
