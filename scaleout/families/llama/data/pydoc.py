"""The offline CPU corpus in the C4 layout: Python's documentation (scaleout/data/corpus.py),
tokenized with a WordPiece vocabulary trained locally (scaleout/data/tokenizer.py) and written
as Megatron-style indexed files, a training split and a held-out evaluation split (documents chosen
by a hash of their name). Built once per machine under a lock in the cache directory, then read.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from scaleout.data.corpus import cache_dir, corpus_hash, is_eval, load_corpus
from scaleout.data.tokenizer import train_or_load
from scaleout.families.llama.data.indexed import token_dtype, write_indexed
from scaleout.fsutil import file_lock

EVAL_FRACTION = 0.05
VERSION = 1  # bump when the build changes, to invalidate caches


def pydoc_corpus(vocab_size: int, cache: str | None = None) -> tuple[str, str]:
    """(train prefix, eval prefix) of the tokenized corpus for a ``vocab_size`` vocabulary."""
    cache = cache or cache_dir()
    with file_lock(os.path.join(cache, "llama-build.lock")):
        docs = load_corpus()
        key = hashlib.sha256(f"{corpus_hash(docs)}:{vocab_size}:{VERSION}".encode()).hexdigest()
        prefix = os.path.join(cache, f"llama-pydoc-{key[:16]}")
        train, held = f"{prefix}-train", f"{prefix}-eval"
        if not all(os.path.exists(f"{p}.idx") for p in (train, held)):
            train_docs = [d for d in docs if not is_eval(d, EVAL_FRACTION)]
            eval_docs = [d for d in docs if is_eval(d, EVAL_FRACTION)]
            tok = train_or_load(
                [s for d in train_docs for s in d.sentences],
                vocab_size,
                corpus_hash(train_docs),
                cache,
            )
            dtype = token_dtype(vocab_size)
            for out, split in ((train, train_docs), (held, eval_docs)):
                write_indexed(
                    out, (np.asarray(tok.encode(" ".join(d.sentences))) for d in split), dtype
                )
    return train, held
