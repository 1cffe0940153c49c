"""MLPerf BERT pre-training shards: the three HDF5 layouts in use, read row by row and written
exactly.

``fixed`` -- the reference's ``create_pretraining_data.py`` output as NVIDIA's MLPerf BERT writes it
to HDF5 (training_results_v0.7 ``create_pretraining_data.py`` and
``cleanup_scripts/chop_hdf5_files.py``), one zero-padded row per sequence::

    input_ids            int32 [N, max_seq_len]    token ids after masking
    input_mask           int8  [N, max_seq_len]    1 on real tokens (defines the sequence length)
    segment_ids          int8  [N, max_seq_len]    0 for [CLS] A [SEP], 1 for B [SEP]
    masked_lm_positions  int32 [N, max_pred]       0 = unused slot (position 0 is [CLS], never
    masked)
    masked_lm_ids        int32 [N, max_pred]       original tokens there, 0 in unused slots
    next_sentence_labels int8  [N]                 1 = B is a random next segment

``varlength`` -- NVIDIA's ``hdf5_4320_shards_varlength`` (v1.0+, ``convert_fixed2variable.py``): the
same rows unpadded as HDF5 variable-length arrays (``input_ids`` vlen int16, ``segment_ids`` vlen
int8, ``masked_lm_positions``/``masked_lm_ids`` vlen int16), ``next_sentence_labels`` int8 [N], no
``input_mask``.

``packed`` -- NVIDIA's packed shards (v2.0+, ``create_packed_trainset.py``): one row per *pack* of
up to 3 sequences, every field vlen (``next_sentence_labels`` int8 per sequence), plus
``packed_input_len`` and ``packed_masked_lm_len`` (int16 per sequence); masked positions count from
the start of the row.

``.npz`` files with the fixed layout's keys are read too (tests, small data). :class:`ShardReader`
opens one file and reads only the rows asked for (h5py reads those rows; nothing else is loaded).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from scaleout.errors import UserError
from scaleout.families.bert.data.pretrain import to_padded
from scaleout.fsutil import atomic_write_path

KEYS = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
VARLEN_KEYS = (
    "input_ids",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
PACKED_KEYS = (*VARLEN_KEYS, "packed_input_len", "packed_masked_lm_len")
LAYOUTS = ("fixed", "varlength", "packed")
SUFFIXES = (".hdf5", ".h5", ".hdf", ".npz")
# Rows read at once when scanning a whole file (lengths): bounds the memory of a scan to a few MB.
SCAN_ROWS = 4096


def h5py_module() -> Any:
    try:
        import h5py
    except ImportError:
        raise UserError(
            "MLPerf HDF5 shards need h5py (pip install 'scaleout[data]'), or .npz shards"
        ) from None
    return h5py


class ShardReader:
    """One shard file, opened for reading rows: ``rows``, ``layout``, ``row_lengths()``,
    ``read(rows)``."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._npz: Any = None
        self._h5: Any = None
        self._arrays: dict[str, np.ndarray] = {}
        try:
            if self.path.suffix == ".npz":
                self._npz = np.load(self.path)
                keys = set(self._npz.files)
            else:
                self._h5 = h5py_module().File(self.path, "r")
                keys = set(self._h5.keys())
        except (OSError, ValueError, zipfile.BadZipFile) as exc:  # np.load: a torn zip, pickles
            raise UserError(f"{self.path}: cannot read as an MLPerf BERT shard ({exc})") from None
        if "packed_input_len" in keys:
            self.layout, need = "packed", PACKED_KEYS
        elif "input_mask" in keys:
            self.layout, need = "fixed", KEYS
        else:
            self.layout, need = "varlength", VARLEN_KEYS
        missing = [k for k in need if k not in keys]
        if missing:
            raise UserError(
                f"{self.path}: missing MLPerf BERT fields {missing}; expected {list(KEYS)} "
                "(or NVIDIA's varlength/packed layouts, see docs/training-blocks.md)"
            )
        self.rows = int(self._dataset("input_ids").shape[0])

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
        if self._npz is not None:
            self._npz.close()
        self._h5 = self._npz = None
        self._arrays.clear()

    def _dataset(self, key: str) -> Any:
        if self._h5 is not None:
            return self._h5[key]
        if key not in self._arrays:  # an npz member is read whole on first use (small files only)
            self._arrays[key] = self._npz[key]
        return self._arrays[key]

    def _get(self, key: str, rows: np.ndarray) -> Any:
        """Rows ``rows`` (increasing, unique) of one field."""
        ds = self._dataset(key)
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):  # contiguous: one slice
            return ds[int(rows[0]) : int(rows[-1]) + 1]
        return ds[rows] if self._h5 is None else ds[rows.tolist()]

    def mask_slots(self) -> int | None:
        """Mask slots per sequence of a fixed-layout file (its masked_lm_positions width), else
        None."""
        return (
            int(self._dataset("masked_lm_positions").shape[1]) if self.layout == "fixed" else None
        )

    # -- lengths (the index is built from these)
    # --------------------------------------------------------
    def row_lengths(self) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """(real tokens per row, per-row sequence lengths for packed rows else None), scanned in
        chunks."""
        tokens, per_seq = np.zeros(self.rows, np.int64), [] if self.layout == "packed" else None
        for a in range(0, self.rows, SCAN_ROWS):
            b = min(a + SCAN_ROWS, self.rows)
            if self.layout == "fixed":
                tokens[a:b] = np.asarray(self._dataset("input_mask")[a:b]).astype(bool).sum(1)
            elif self.layout == "varlength":
                tokens[a:b] = [len(x) for x in self._dataset("input_ids")[a:b]]
            else:
                lens = [np.asarray(x, np.int64) for x in self._dataset("packed_input_len")[a:b]]
                tokens[a:b] = [int(x.sum()) for x in lens]
                per_seq.extend(lens)
        return tokens, per_seq

    # -- rows -> sequences
    # -----------------------------------------------------------------------------
    def read(self, rows: np.ndarray | list[int]) -> list[list[Any]]:
        """The sequences of each row in ``rows`` (any order, repeats allowed) as
        :class:`~scaleout.families.bert.data.bert_batch.BertSequence` (NSP converted to
        bert_batch's 1 = is-next)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise UserError(f"{self.path}: row {int(rows.max())} is outside 0..{self.rows - 1}")
        uniq, where = np.unique(rows, return_inverse=True)
        keys = {"fixed": KEYS, "varlength": VARLEN_KEYS, "packed": PACKED_KEYS}[self.layout]
        got = {k: self._get(k, uniq) for k in keys}
        decoded = [self._row(got, i) for i in range(len(uniq))]
        return [decoded[i] for i in where]

    def _row(self, got: dict[str, Any], i: int) -> list[Any]:
        from scaleout.families.bert.data.bert_batch import BertSequence  # deferred: pulls in torch

        nsp = np.asarray(got["next_sentence_labels"][i]).reshape(-1)
        if self.layout == "fixed":
            n = int(np.asarray(got["input_mask"][i]).astype(bool).sum())
            ids, seg = np.asarray(got["input_ids"][i])[:n], np.asarray(got["segment_ids"][i])[:n]
        else:
            ids, seg = np.asarray(got["input_ids"][i]), np.asarray(got["segment_ids"][i])
        pos, lab = np.asarray(got["masked_lm_positions"][i]), np.asarray(got["masked_lm_ids"][i])
        if self.layout != "packed":
            keep = pos > 0  # 0 = unused slot; [CLS] at 0 is never masked
            return [
                BertSequence(
                    ids.astype(np.int32),
                    seg.astype(np.int8),
                    pos[keep].astype(np.int32),
                    lab[keep].astype(np.int32),
                    1 - int(nsp[0]),
                )
            ]
        out, start, m = [], 0, 0
        for j, (n, k) in enumerate(
            zip(
                np.asarray(got["packed_input_len"][i]),
                np.asarray(got["packed_masked_lm_len"][i]),
                strict=True,
            )
        ):
            n, k = int(n), int(k)
            out.append(
                BertSequence(
                    ids[start : start + n].astype(np.int32),
                    seg[start : start + n].astype(np.int8),
                    (pos[m : m + k] - start).astype(np.int32),
                    lab[m : m + k].astype(np.int32),
                    1 - int(nsp[j]),
                )
            )
            start, m = start + n, m + k
        return out


def shard_files(path: str | os.PathLike[str]) -> list[Path]:
    """A shard file, or the shard files of a directory in sorted order."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
    else:
        raise UserError(
            f"data.path={path} does not exist; expected a shard file or a directory of {SUFFIXES} "
            "files"
        )
    if not files:
        raise UserError(f"data.path={path} has no {'/'.join(SUFFIXES)} shards")
    return files


# -- writing
# --------------------------------------------------------------------------------------------
def write_shard(
    path: str | os.PathLike[str],
    rows: list[list[Any]],
    layout: str,
    max_seq_len: int,
    max_pred: int,
) -> None:
    """Write ``rows`` (each a list of :class:`BertSample` records: one per row unless ``packed``) in
    ``layout`` with the reference's dtypes; atomically (``.tmp`` then rename)."""
    if layout not in LAYOUTS:
        raise UserError(f"shard layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    h5py = h5py_module()

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            if layout == "fixed":
                _write_fixed(f, rows, max_seq_len, max_pred)
            else:
                _write_vlen(f, h5py, rows, layout)

    atomic_write_path(path, write)


def _write_fixed(f: Any, rows: list[list[Any]], max_seq_len: int, max_pred: int) -> None:
    if any(len(r) != 1 for r in rows):
        raise UserError("the fixed layout holds one sequence per row")
    padded = [to_padded(r[0], max_seq_len, max_pred) for r in rows]
    dtypes = {
        "input_ids": "i4",
        "input_mask": "i1",
        "segment_ids": "i1",
        "masked_lm_positions": "i4",
        "masked_lm_ids": "i4",
        "next_sentence_labels": "i1",
    }
    for k, dt in dtypes.items():
        f.create_dataset(k, data=np.stack([p[k] for p in padded]).astype(dt), dtype=dt)


def _write_vlen(f: Any, h5py: Any, rows: list[list[Any]], layout: str) -> None:
    n = len(rows)
    i16, i8 = h5py.vlen_dtype(np.dtype("int16")), h5py.vlen_dtype(np.dtype("int8"))
    cols: dict[str, list[np.ndarray]] = {k: [] for k in PACKED_KEYS}
    for r in rows:
        if layout == "varlength" and len(r) != 1:
            raise UserError("the varlength layout holds one sequence per row")
        starts = np.cumsum([0] + [len(s) for s in r])[:-1]
        cols["input_ids"].append(np.concatenate([s.input_ids for s in r]).astype(np.int16))
        cols["segment_ids"].append(np.concatenate([s.token_type_ids for s in r]).astype(np.int8))
        cols["masked_lm_positions"].append(
            np.concatenate(
                [s.masked_positions + st for s, st in zip(r, starts, strict=True)]
            ).astype(np.int16)
        )
        cols["masked_lm_ids"].append(np.concatenate([s.masked_labels for s in r]).astype(np.int16))
        cols["next_sentence_labels"].append(np.array([s.nsp_label for s in r], np.int8))
        cols["packed_input_len"].append(np.array([len(s) for s in r], np.int16))
        cols["packed_masked_lm_len"].append(
            np.array([len(s.masked_positions) for s in r], np.int16)
        )
    vlen = {
        "input_ids": i16,
        "segment_ids": i8,
        "masked_lm_positions": i16,
        "masked_lm_ids": i16,
        "next_sentence_labels": i8,
        "packed_input_len": i16,
        "packed_masked_lm_len": i16,
    }
    keys = PACKED_KEYS if layout == "packed" else VARLEN_KEYS
    for k in keys:
        if layout == "varlength" and k == "next_sentence_labels":
            f.create_dataset(k, data=np.array([c[0] for c in cols[k]], np.int8), dtype="i1")
            continue
        # an object array of 1-D arrays: one write, any row lengths
        data = np.empty(n, dtype=object)
        for i, v in enumerate(cols[k]):
            data[i] = v
        f.create_dataset(k, data=data, dtype=vlen[k])
