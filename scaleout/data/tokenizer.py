"""A WordPiece tokenizer trained locally in pure Python (BERT-style, uncased).

Pre-tokenisation follows BERT's basic tokenizer: lower-case, split on whitespace and around every
punctuation character. The vocabulary is learned with byte-pair-encoding merges over word
frequencies, with word-internal pieces written ``##piece`` -- the way HuggingFace's WordPiece
trainer builds a vocabulary -- and text is encoded with WordPiece's greedy longest-match-first (a
word that cannot be covered becomes ``[UNK]``, as in BERT). Merges are chosen by (count, then the
pair itself), so training is deterministic. A max-heap with lazy deletion keeps training at a few
seconds for the ~2 MB pydoc+stdlib corpus. Trained vocabularies are cached as JSON keyed by a hash
of the corpus and the settings (see :func:`train_or_load`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from itertools import pairwise

from scaleout.data.corpus import cache_dir
from scaleout.errors import UserError
from scaleout.fsutil import atomic_write

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_WORD = re.compile(r"\w+|[^\w\s]", re.UNICODE)
MAX_WORD_CHARS = 100  # BERT's max_input_chars_per_word: longer words are [UNK]
VERSION = 1  # bump when training changes, to invalidate caches


def pre_tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class WordPiece:
    def __init__(self, vocab: list[str]):
        if list(vocab[: len(SPECIALS)]) != list(SPECIALS):
            raise UserError(f"a WordPiece vocabulary must start with {SPECIALS}, got {vocab[:5]}")
        self.vocab = list(vocab)
        self.ids = {t: i for i, t in enumerate(self.vocab)}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = range(5)
        self._cache: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self.vocab)

    def encode_word(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        out: list[int] = []
        if len(word) > MAX_WORD_CHARS:
            out = [self.unk_id]
        else:
            start = 0
            while start < len(word):
                end, piece = len(word), None
                while end > start:
                    sub = word[start:end] if start == 0 else "##" + word[start:end]
                    if sub in self.ids:
                        piece = self.ids[sub]
                        break
                    end -= 1
                if piece is None:
                    out = [self.unk_id]
                    break
                out.append(piece)
                start = end
        self._cache[word] = out
        return out

    def encode(self, text: str) -> list[int]:
        return [i for w in pre_tokenize(text) for i in self.encode_word(w)]

    def decode(self, ids: Iterable[int]) -> str:
        text = ""
        for i in ids:
            t = self.vocab[int(i)]
            text += t[2:] if t.startswith("##") else (" " + t if text else t)
        return text

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "vocab": self.vocab})

    @classmethod
    def from_json(cls, text: str) -> WordPiece:
        return cls(json.loads(text)["vocab"])


def train_wordpiece(
    texts: Iterable[str], vocab_size: int = 4096, max_alphabet: int | None = None
) -> WordPiece:
    """Learn a vocabulary of ``vocab_size`` tokens (specials + characters + merged pieces)."""
    if vocab_size < len(SPECIALS) + 2:
        raise UserError(
            f"vocab_size={vocab_size} is too small; expected at least {len(SPECIALS) + 2}"
        )
    freq: Counter[str] = Counter()
    for t in texts:
        freq.update(pre_tokenize(t))
    freq = Counter({w: c for w, c in freq.items() if len(w) <= MAX_WORD_CHARS})
    # initial alphabet: word-initial chars and "##" continuation chars, most frequent first
    chars: Counter[str] = Counter()
    for w, c in freq.items():
        chars[w[0]] += c
        for ch in w[1:]:
            chars["##" + ch] += c
    budget = max_alphabet or max(vocab_size // 4, 1)
    alphabet = [s for s, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))[:budget]]
    allowed = set(alphabet)
    words: list[list[str]] = []
    counts: list[int] = []
    for w, c in sorted(freq.items()):
        syms = [w[0]] + ["##" + ch for ch in w[1:]]
        if all(s in allowed for s in syms) and len(syms) > 1:
            words.append(syms)
            counts.append(c)
    vocab = list(SPECIALS) + sorted(alphabet, key=lambda s: (-chars[s], s))
    seen = set(vocab)

    pair_count: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, syms in enumerate(words):
        for p in pairwise(syms):
            pair_count[p] += counts[i]
            where.setdefault(p, set()).add(i)
    heap = [(-c, p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale heap entry
        a, b = pair
        new = a + b[2:]
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, ())):
            syms, c = words[i], counts[i]
            for p in pairwise(syms):
                pair_count[p] -= c
                touched.add(p)
            merged, j = [], 0
            while j < len(syms):
                if j + 1 < len(syms) and syms[j] == a and syms[j + 1] == b:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(syms[j])
                    j += 1
            words[i] = merged
            for p in pairwise(merged):
                pair_count[p] += c
                where.setdefault(p, set()).add(i)
                touched.add(p)
        pair_count.pop(pair, None)
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
        if new not in seen:
            seen.add(new)
            vocab.append(new)
    return WordPiece(vocab)


def train_or_load(
    texts: list[str], vocab_size: int, corpus_key: str, cache: str | None = None
) -> WordPiece:
    """Train once per (corpus, vocab_size, algorithm version); later calls read
    ``wordpiece-<key>.json``."""

    key = hashlib.sha256(f"{corpus_key}:{vocab_size}:{VERSION}".encode()).hexdigest()[:16]
    path = os.path.join(cache or cache_dir(), f"wordpiece-{key}.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                return WordPiece.from_json(f.read())
        except (ValueError, KeyError, UserError):
            pass  # a damaged cache file is rebuilt below
    tok = train_wordpiece(texts, vocab_size)
    atomic_write(path, tok.to_json())  # concurrent ranks may race to write the same file
    return tok
