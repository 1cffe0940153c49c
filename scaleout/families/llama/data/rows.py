"""Training rows of ``seq_len`` tokens from an indexed corpus, documents kept apart.

The corpus's documents are laid end to end in a (seeded) document order and cut every ``seq_len``
tokens, as Megatron's GPT dataset builds its samples, so no token is padding. Unlike Megatron's
default, a row also carries each token's document id: the model restarts positions at every
document and never attends across one (scaleout/families/llama/model.py), and a document cut by a
row boundary continues as a new document in the next row.

The row index is two int64 arrays of one entry per row (the document and the offset it starts at),
built once from the documents' sizes.
"""

from __future__ import annotations

import numpy as np

from scaleout.families.llama.data.indexed import IndexedTokens


class Rows:
    """Row ``r`` of ``seq_len`` tokens: ``(tokens, doc_ids)``, both int64 arrays."""

    def __init__(self, corpus: IndexedTokens, seq_len: int, seed: int | None = None):
        self.corpus, self.seq_len = corpus, seq_len
        order = np.arange(len(corpus))
        if seed is not None:
            order = np.random.default_rng(seed).permutation(len(corpus))
        self.order = order
        sizes = corpus.sizes[order].astype(np.int64)
        ends = np.cumsum(sizes)  # end of document k of the order in the concatenated stream
        self.rows = int(ends[-1] // seq_len) if len(ends) else 0
        starts = np.arange(self.rows, dtype=np.int64) * seq_len
        # first document of each row, and how far into it the row starts
        self.first = np.searchsorted(ends, starts, side="right")
        self.offset = starts - (ends[self.first] - sizes[self.first])

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.empty(self.seq_len, dtype=np.int64)
        doc_ids = np.empty(self.seq_len, dtype=np.int64)
        k, at, filled = int(self.first[r]), int(self.offset[r]), 0
        while filled < self.seq_len:
            doc = self.corpus[int(self.order[k])][at:]
            take = min(len(doc), self.seq_len - filled)
            tokens[filled : filled + take] = doc[:take]
            doc_ids[filled : filled + take] = k
            filled, k, at = filled + take, k + 1, 0
        return tokens, doc_ids
