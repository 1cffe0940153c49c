"""How the gloo row x column pipeline cuts a buffer into chunks (torch-free): the runtime
(:mod:`scaleout.comm.grid`), the algorithms' options and cost (:mod:`scaleout.comm.rowcol`) and the
simulator read these from here, below all of them.
"""

from __future__ import annotations

# Chunk size of the gloo pipeline. 4 MiB: big enough that per-chunk synchronisation (~2-3 ms on a
# busy 2-core box, hidden behind the in-flight column all-reduces) stays small next to a chunk's ~35
# ms on a 1 Gbit link, small enough that pipeline fill + drain (one chunk's reduce-scatter and
# all-gather over loopback) stays a few % of a 64 MiB all-reduce. 2, 4 and 8 MiB measured within
# noise of each other (docs/collectives.md, `scaleout bench allreduce --chunk-bytes
# 2MiB,4MiB,8MiB`).
DEFAULT_CHUNK_BYTES = 4 << 20
# At most this many chunks per call: each chunk costs ~2-3 ms of synchronisation on a 2-core box
# (measured: 1M fp32 in 16 KiB chunks = 245 chunks took 0.57 s vs 0.04 s in 1 MiB chunks).
MAX_CHUNKS = 64


def gloo_chunks(nbytes: float, chunk_bytes: int | None = None) -> int:
    """How many chunks scaleout.comm.grid's gloo pipeline cuts ``nbytes`` into."""
    return int(min(MAX_CHUNKS, max(1, -(-nbytes // (chunk_bytes or DEFAULT_CHUNK_BYTES)))))
