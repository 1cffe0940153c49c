"""scaleout data pack: packing strategies for a sequence-length histogram or a dataset, side by
side."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "pack"
# A data tool, beside make-shards and index: `scaleout data pack`.
GROUP = "data"
HELP = (
    "sequence packing: compare SPFHP/LPFHP/NNLSHP/LPHP on a histogram, write the strategy (and "
    "packs)"
)
DESCRIPTION = """\
scaleout data pack [HISTOGRAM | --lengths FILE] --max-len 512 --max-per-pack 3 [--packing a,b]
    [--out S.json]

Runs every algorithm on a sequence-length histogram (Graphcore's format: 'length count' lines, '#'
comments) or on a dataset given as its sequence lengths (--lengths: one integer per line, or a .npy
array), prints efficiency (real tokens / (packs x max_len)), speed-up (sequences / packs), depth
histogram and run time side by side, and writes the most efficient strategy as JSON. With --lengths
and --packed-out it also assigns every sequence to a pack (deterministic for --seed) and writes ids
+ offsets (.npz): pack i holds ids[offsets[i]:offsets[i+1]].

Algorithms: spfhp, lpfhp, nnlshp (Graphcore, arXiv 2107.02027) and lphp (ours: LP over exact-fill
packs, rounded; see docs/packing.md). nnlshp takes ~20-40 s on Wikipedia-512.

examples:
  scaleout data pack ../shared/data/wikipedia_seqlen_hist_512.txt --max-per-pack 3
  scaleout data pack ../shared/data/wikipedia_seqlen_hist_512.txt --max-per-pack 12 \\
      --packing spfhp,lpfhp,lphp
  scaleout data pack --lengths lengths.txt --max-len 128 --out strategy.json --packed-out packed.npz
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.argtypes import bounded
    from scaleout.section import MAX_WORLD  # numpy-free: `scaleout --help` imports this

    p.add_argument("histogram", nargs="?", help="histogram file ('length count' lines)")
    p.add_argument("--lengths", help="dataset as sequence lengths: text (one per line) or .npy")
    p.add_argument("--max-len", type=int, default=512, help="tokens per pack (default 512)")
    p.add_argument(
        "--max-per-pack",
        type=bounded(int, 1, MAX_WORLD),  # packing checks it against --max-len
        default=3,
        help="sequences per pack (default 3, NVIDIA MLPerf BERT)",
    )
    p.add_argument(
        "--packing",
        default="spfhp,lpfhp,nnlshp,lphp",
        help="packing algorithms to compare, comma list (default: all)",
    )
    p.add_argument("--out", default=None, help="write the strategy as JSON here (default: none)")
    p.add_argument(
        "--packed-out", default=None, help="with --lengths: write packed ids/offsets (.npz)"
    )
    p.add_argument(
        "--seed",
        type=bounded(int, 0, 2**32 - 1),
        default=0,
        help="seed of the sequence-to-pack assignment",
    )


def _read_lengths(path: str):
    """Integer sequence lengths from a text file (one per line) or an integer .npy array;
    one-line errors."""

    import numpy as np

    from scaleout.errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"lengths file {path!r} not found")
    if p.suffix == ".npy":
        try:
            arr = np.load(p)  # allow_pickle=False: object arrays are refused, never unpickled
        except (ValueError, OSError, EOFError) as exc:
            raise UserError(
                f"lengths file {path!r}: not a readable numeric .npy array ({exc})"
            ) from None
        if not np.issubdtype(arr.dtype, np.integer):
            example = arr.reshape(-1)[:1].tolist()
            raise UserError(
                f"lengths file {path!r}: {arr.dtype} array (e.g. "
                f"{example[0] if example else '?'!r}), expected integer "
                "sequence lengths (a float array would be truncated silently)"
            )
        if arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise UserError(f"lengths file {path!r}: length {int(arr.max())} does not fit int64")
        return np.asarray(arr, dtype=np.int64).reshape(-1)
    values = []
    for no, word in enumerate(p.read_text(errors="replace").split(), 1):
        try:
            values.append(int(word))
        except ValueError:
            raise UserError(
                f"{path}: item {no} {word!r}: expected one integer sequence length per line"
            ) from None
        if abs(values[-1]) > np.iinfo(np.int64).max:
            raise UserError(f"{path}: item {no} {word!r}: length does not fit int64")
    return np.array(values, dtype=np.int64)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from scaleout.argtypes import parse_csv
    from scaleout.errors import UserError
    from scaleout.families.bert.packing import (
        ALGORITHMS,
        assign_sequences,
        histogram_from_lengths,
        load_histogram,
        pack_histogram,
        speedup_ceiling,
    )
    from scaleout.families.bert.packing.hist import check_max_len
    from scaleout.output import format_table
    from scaleout.pathcheck import check_writable_file

    check_max_len(args.max_len)
    if (args.histogram is None) == (args.lengths is None):
        raise UserError("give exactly one of HISTOGRAM or --lengths FILE")
    if args.packed_out and not args.lengths:
        raise UserError("--packed-out needs a dataset (--lengths FILE), not only a histogram")
    names = parse_csv(args.packing, "--packing", choices=ALGORITHMS)
    # where the results go is checked before the packing (seconds to minutes), not after it
    for flag, out_path in (("--out", args.out), ("--packed-out", args.packed_out)):
        if out_path:
            check_writable_file(out_path, flag)
    if args.lengths:
        lengths = _read_lengths(args.lengths)
        h = histogram_from_lengths(lengths, args.max_len)
    else:
        h = load_histogram(args.histogram, args.max_len)
    tokens = int((h * np.arange(len(h))).sum())
    print(
        f"{int(h.sum())} sequences, {tokens} tokens, max_len {args.max_len}, <= "
        f"{args.max_per_pack} per pack; "
        f"speed-up ceiling {speedup_ceiling(h):.4f}",
        flush=True,
    )
    results = []
    for a in names:
        s = pack_histogram(h, args.max_len, args.max_per_pack, a)
        results.append(s)
        print(f"  {a}: done in {s.seconds:.3f} s", flush=True)
    rows = [
        [
            s.algorithm,
            f"{s.efficiency:.5f}",
            f"{s.speedup:.4f}",
            s.num_packs,
            len(s.packs),
            " ".join(f"{d}:{n}" for d, n in s.depth_histogram().items()),
            f"{s.seconds:.3f}",
            f"{s.cpu_seconds:.3f}",
        ]
        for s in results
    ]
    print(
        format_table(
            [
                "algorithm",
                "efficiency",
                "speed-up",
                "packs",
                "strategies",
                "depth histogram",
                "wall s",
                "cpu s",
            ],
            rows,
        )
    )
    best = max(results, key=lambda s: (s.efficiency, -s.seconds))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({**best.to_json(), "compared": [s.stats() for s in results]}, indent=1)
        )
        print(f"strategy ({best.algorithm}) written to {out}")
    if args.packed_out:
        packed = assign_sequences(best, lengths, seed=args.seed)
        Path(args.packed_out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.packed_out, "wb") as f:
            np.savez(f, ids=packed.ids, offsets=packed.offsets, lengths=lengths)
        print(f"{len(packed)} packs of {len(lengths)} sequences written to {args.packed_out}")
    return 0
