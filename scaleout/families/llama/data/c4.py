"""MLPerf ``llama31_8b``'s C4 as the reference preprocesses it (mlcommons/training
``small_llm_pretraining/nemo/README.md``): Megatron indexed files under ``data.path``,

* ``c4-train.en_<k>_text_document.{bin,idx}`` (k = 0..7: C4's training shards 768-1023, merged),
* ``c4-validation-91205-samples.en_text_document.{bin,idx}`` (the first 91,205 documents of C4's
  unshuffled validation split; the evaluation reads its first 1,024 sequences, unshuffled).

The training files are read as one corpus (:class:`ChainedTokens`), in file order; rows are cut
from it by :class:`scaleout.families.llama.data.rows.Rows`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from scaleout.errors import UserError
from scaleout.families.llama.data.indexed import IndexedTokens

TRAIN_GLOB = "c4-train.en_*_text_document.idx"
VALIDATION = "c4-validation-91205-samples.en_text_document"


class ChainedTokens:
    """Several indexed files as one: ``len()`` documents, ``[i]`` one document's tokens, ``sizes``
    (what :class:`Rows` reads)."""

    def __init__(self, parts: list[IndexedTokens]):
        self.parts = parts
        self.sizes = np.concatenate([p.sizes for p in parts]) if parts else np.zeros(0, np.int32)
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.parts[k][i - int(self.starts[k])]

    @property
    def total_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


def c4_corpus(path: str | os.PathLike[str] | None) -> tuple[ChainedTokens, IndexedTokens]:
    """The training corpus and the validation file under ``path`` (data.path)."""
    if path is None:
        raise UserError("data.source=c4 needs data.path: the folder of the preprocessed C4 files")
    root = Path(path)
    train = sorted(root.glob(TRAIN_GLOB), key=_shard_number)
    if not train:
        raise UserError(f"data.path={os.fspath(path)!r}: no {TRAIN_GLOB} (MLPerf's C4 layout)")
    parts = [IndexedTokens(p.with_suffix("")) for p in train]
    return ChainedTokens(parts), IndexedTokens(root / VALIDATION)


def _shard_number(p: Path) -> int:
    digits = p.name[len("c4-train.en_") :].split("_", 1)[0]
    return int(digits) if digits.isdigit() else -1
