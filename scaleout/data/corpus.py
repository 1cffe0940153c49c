"""An English text corpus that exists offline on every machine: Python's own documentation.

Two sources, both shipped with CPython, read in a fixed order so the corpus is identical wherever
the same Python version runs:

* ``pydoc_data.topics.topics``: the language reference / library topics behind ``help()``
  (79 documents, ~0.46 MB of text on 3.11), one document per topic, sorted by name.
* Docstrings of the standard library (~1.7 MB on 3.11): every ``*.py`` file under the stdlib
  directory (sorted walk, skipping ``site-packages``, test suites and demos) is *parsed* with
  :mod:`ast`, never imported -- importing arbitrary stdlib modules has side effects (``antigravity``
  opens a browser, ``this`` prints, GUI modules need a display). One document per file: its module,
  class and function docstrings in source order.

Documents are split into sentences (paragraphs on blank lines; sentence ends at ``.!?`` followed by
a capitalised word); doctest lines (``>>>``, ``...``) are dropped. Eval documents are chosen by a
hash of the document name (stable when the corpus grows).
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

from scaleout.errors import UserError

SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "venv",
}
_SENT_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z])")
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class Document:
    name: str
    sentences: tuple[str, ...]


def split_sentences(text: str) -> list[str]:
    """Paragraphs (blank-line separated) -> sentences; drops doctest lines and empty text."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln for ln in para.splitlines() if not ln.lstrip().startswith((">>>", "... "))]
        flat = _WS.sub(" ", " ".join(lines)).strip()
        if flat:
            out.extend(s.strip() for s in _SENT_END.split(flat) if s.strip())
    return out


def pydoc_documents() -> list[Document]:
    from pydoc_data.topics import topics  # deferred: 700 kB of text, read once

    return [Document(f"pydoc:{k}", tuple(split_sentences(topics[k]))) for k in sorted(topics)]


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                found.append((getattr(node, "lineno", 0), doc))
    return [d for _, d in sorted(found, key=lambda t: t[0])]


def stdlib_files(root: str | None = None) -> Iterator[str]:
    """The standard library's ``.py`` files the corpus reads, in a fixed order: not the installed
    packages (``site-packages``: torch alone is ~15k files), tests or hidden folders."""
    root = root or sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def stdlib_documents(root: str | None = None) -> list[Document]:
    root = root or sysconfig.get_paths()["stdlib"]
    docs: list[Document] = []
    for path in stdlib_files(root):
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts = _docstrings(fh.read())
        sentences = [s for t in texts for s in split_sentences(t)]
        if sentences:
            docs.append(Document(f"stdlib:{os.path.relpath(path, root)}", tuple(sentences)))
    return docs


def load_corpus(sources: tuple[str, ...] = ("pydoc", "stdlib")) -> list[Document]:
    """Documents of the requested sources, in a fixed order."""
    docs: list[Document] = []
    for s in sources:
        if s == "pydoc":
            docs += pydoc_documents()
        elif s == "stdlib":
            docs += stdlib_documents()
        else:
            raise UserError(f"unknown corpus source '{s}'; expected 'pydoc' or 'stdlib'")
    return docs


def corpus_hash(docs: list[Document]) -> str:
    """sha256 over names and sentences: the cache key of everything derived from the corpus."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode())
        for s in d.sentences:
            h.update(b"\0" + s.encode())
        h.update(b"\1")
    return h.hexdigest()


def is_eval(doc: Document, fraction: float) -> bool:
    """Deterministic held-out split by a hash of the document name."""
    v = int.from_bytes(hashlib.sha256(doc.name.encode()).digest()[:8], "little") / 2**64
    return v < fraction


def cache_dir() -> str:
    """``$SCALEOUT_CACHE`` or ``~/.cache/scaleout``."""
    d = os.environ.get("SCALEOUT_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "scaleout"
    )
    os.makedirs(d, exist_ok=True)
    return d
