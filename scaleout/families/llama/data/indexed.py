"""Megatron-style indexed token files, the layout MLPerf's Llama 3.1 8B reference reads (C4
tokenized to ``<prefix>.bin`` + ``<prefix>.idx``).

``.bin`` is every document's tokens back to back. ``.idx`` is a header and three arrays:

    magic  b"MMIDIDX\\x00\\x00"   9 bytes
    version  uint64 = 1
    dtype code  uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    sequence count  uint64        N
    document count  uint64        D + 1
    sizes      int32[N]   tokens of each sequence
    pointers   int64[N]   byte offset of each sequence in .bin
    documents  int64[D+1] index of each document's first sequence, then N

Both files are memory-mapped: opening one reads the 34-byte header, and a rank touches only the
pages of the sequences it reads (O(1) metadata per rank, whatever the corpus size).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from scaleout.errors import UserError
from scaleout.fsutil import atomic_write_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(t): c for c, t in DTYPES.items()}
HEADER = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype Megatron's preprocessing picks for a vocabulary: uint16 below 65,500
    tokens, int32 above (Llama 3's 128,256)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def write_indexed(
    prefix: str | os.PathLike[str], docs: Iterable[np.ndarray], dtype: np.dtype
) -> int:
    """Write ``docs`` (one token array each, one sequence per document) as ``prefix.bin`` and
    ``prefix.idx``, each atomically. Returns the number of documents."""
    dtype = np.dtype(dtype)
    if dtype not in CODES:
        raise UserError(f"token dtype {dtype}: expected one of {', '.join(map(str, CODES))}")
    sizes: list[int] = []

    def write_bin(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            for d in docs:
                arr = np.asarray(d)
                if arr.ndim != 1 or (
                    arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max)
                ):
                    raise UserError(f"document {len(sizes)}: expected 1-D token ids within {dtype}")
                f.write(arr.astype(dtype, copy=False).tobytes())
                sizes.append(arr.size)

    atomic_write_path(f"{os.fspath(prefix)}.bin", write_bin)
    n = len(sizes)
    size_arr = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(n, dtype=np.int64)
    if n:
        pointers[1:] = np.cumsum(size_arr[:-1].astype(np.int64)) * dtype.itemsize
    documents = np.arange(n + 1, dtype=np.int64)

    def write_idx(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODES[dtype], n, n + 1))
            f.write(size_arr.tobytes() + pointers.tobytes() + documents.tobytes())

    atomic_write_path(f"{os.fspath(prefix)}.idx", write_idx)
    return n


class IndexedTokens:
    """A read-only, memory-mapped ``prefix.bin``/``prefix.idx`` pair: ``len()`` documents,
    ``[i]`` one document's tokens (a view into the mapped file)."""

    def __init__(self, prefix: str | os.PathLike[str]):
        idx, bin_ = Path(f"{os.fspath(prefix)}.idx"), Path(f"{os.fspath(prefix)}.bin")
        for p in (idx, bin_):
            if not p.is_file():
                raise UserError(f"{p}: no such file (expected a Megatron indexed dataset prefix)")
        with open(idx, "rb") as f:
            head = f.read(HEADER.size)
        if len(head) < HEADER.size or head[:9] != MAGIC:
            raise UserError(f"{idx}: not a Megatron .idx file (bad magic {head[:9]!r})")
        _, version, code, n, ndocs = HEADER.unpack(head)
        if version != VERSION or code not in DTYPES:
            raise UserError(f"{idx}: version {version}, dtype code {code}: expected 1 and 1-8")
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        off = HEADER.size
        want = off + 12 * n + 8 * ndocs
        if index.size != want:
            raise UserError(f"{idx}: {index.size} bytes, expected {want} for {n} sequences")
        self.sizes = np.frombuffer(index, np.int32, n, off)
        self.pointers = np.frombuffer(index, np.int64, n, off + 4 * n)
        self.documents = np.frombuffer(index, np.int64, ndocs, off + 12 * n)
        self.tokens = np.memmap(bin_, mode="r", dtype=self.dtype)
        end = int(self.pointers[-1]) // self.dtype.itemsize + int(self.sizes[-1]) if n else 0
        if self.tokens.size < end:
            raise UserError(f"{bin_}: {self.tokens.size} tokens, the index needs {end}")

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]

    @property
    def total_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))
