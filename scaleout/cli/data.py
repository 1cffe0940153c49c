"""scaleout data: MLPerf BERT shards -- write them from the offline corpus, index them for lazy
training; Fashion-MNIST written once as PNG class folders (the ResNet CPU time-to-train data)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NAME = "data"
ORDER = 42
HELP = (
    "MLPerf BERT shards: 'make-shards' (offline corpus -> HDF5 in the MLPerf layout), 'index' "
    "(lazy training), 'prepare-fashion-mnist' (PNG class folders for ResNet)"
)
DESCRIPTION = """\
scaleout data make-shards DIR --shards N [--layout fixed|varlength|packed] [--max-seq-len 128] ...
scaleout data index DIR [--max-seq-len 512] [--packing lphp] [--max-per-pack 3] [--seed 0]
scaleout data prepare-fashion-mnist [--out runs/data/fashion-mnist] [--source DIR]

make-shards: N training shards (DIR/train/part_0000i_of_0000N.hdf5) and an eval file (DIR/eval/) in
the MLPerf BERT HDF5 format -- input_ids, input_mask, segment_ids, masked_lm_positions,
masked_lm_ids, next_sentence_labels with the reference's dtypes and shapes (--layout fixed), or
NVIDIA's variable-length (v1.0+) or packed (v2.0+) layouts -- from the offline pydoc/stdlib corpus,
plus DIR/vocab.txt. Train on it with data.source=wikipedia data.path=DIR.

index: builds the per-shard length index and packs that lazy training reads
(DIR/train/.scaleout-index); training builds it itself when missing (in parallel over the ranks),
this does it ahead of time.

prepare-fashion-mnist: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist/*.gz)
written once as 28x28 PNGs into OUT/train/<class>/<i>.png (60,000) and OUT/val/<class>/<i>.png
(10,000), classes 0_tshirt ... 9_ankle_boot; a marker file makes a second call instant. Train on it
with data.source=images data.path=OUT (configs/resnet_cpu.yaml; its data.prepare: fashion-mnist
runs this on first use).

examples:
  scaleout data make-shards /tmp/shards --shards 8
  scaleout data make-shards /tmp/packed --shards 4 --layout packed --max-seq-len 128
  scaleout data index /tmp/shards --max-seq-len 128 --packing lphp
  scaleout data prepare-fashion-mnist --out runs/data/fashion-mnist
  scaleout launch --nproc-per-node 2 -- scaleout train bert_tiny_cpu data.source=wikipedia
  data.path=/tmp/shards
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    m = sub.add_parser("make-shards", help="offline corpus -> MLPerf BERT HDF5 shards")
    m.add_argument("dir", help="output directory (train/ and eval/ are created in it)")
    m.add_argument("--shards", type=int, required=True, help="number of training shards")
    m.add_argument(
        "--layout", default="fixed", help="fixed (reference), varlength or packed (NVIDIA)"
    )
    m.add_argument("--max-seq-len", type=int, default=128, help="tokens per sequence (MLPerf: 512)")
    m.add_argument(
        "--max-predictions", type=int, default=20, help="mask slots per sequence (MLPerf: 76)"
    )
    m.add_argument(
        "--vocab-size", type=int, default=4096, help="WordPiece vocabulary trained on the corpus"
    )
    m.add_argument(
        "--dupe-factor", type=int, default=5, help="copies of the corpus with different masks"
    )
    m.add_argument(
        "--eval-samples", type=int, default=None, help="eval sequences (default: all held-out ones)"
    )
    m.add_argument(
        "--packing", default="lphp", help="--layout packed: packing algorithm (default lphp)"
    )
    m.add_argument(
        "--max-per-pack", type=int, default=3, help="--layout packed: sequences per row (default 3)"
    )
    m.add_argument("--seed", type=int, default=0)
    i = sub.add_parser("index", help="build the lazy-training index of a shard directory")
    i.add_argument("dir", help="shard directory (with train/ and eval/, or the shards themselves)")
    i.add_argument("--max-seq-len", type=int, default=512)
    i.add_argument("--packing", default="lphp", help="none, spfhp, lpfhp, nnlshp, lphp or auto")
    i.add_argument("--max-per-pack", type=int, default=3)
    i.add_argument("--seed", type=int, default=0, help="data.seed of the runs that will read it")
    f = sub.add_parser(
        "prepare-fashion-mnist", help="Fashion-MNIST idx files -> PNG class folders (once)"
    )
    f.add_argument("--out", default=None, help="output directory (default runs/data/fashion-mnist)")
    f.add_argument(
        "--source",
        default=None,
        help="idx .gz directory (default /usr/share/datasets/fashion-mnist)",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "prepare-fashion-mnist":
        return _prepare_fashion_mnist(args)
    if args.action == "make-shards":
        from scaleout.families.bert.data.make_shards import make_shards

        t = time.perf_counter()
        info = make_shards(
            args.dir,
            args.shards,
            args.layout,
            args.max_seq_len,
            args.max_predictions,
            args.vocab_size,
            args.dupe_factor,
            args.seed,
            args.eval_samples,
            args.packing,
            args.max_per_pack,
        )
        print(
            f"{len(info['train'])} {info['layout']} training shards ({info['train_sequences']} "
            "sequences, "
            f"{info['train_tokens']} tokens) and {info['eval']} ({info['eval_sequences']} "
            "sequences) "
            f"in {time.perf_counter() - t:.1f} s"
        )
        return 0

    from scaleout.errors import UserError
    from scaleout.families.bert.data.shard_format import shard_files
    from scaleout.families.bert.data.shard_index import PackSettings, ensure_index
    from scaleout.families.bert.packing.algos import ALGORITHMS

    if args.packing not in (*ALGORITHMS, "auto", "none"):
        raise UserError(
            f"--packing {args.packing!r}: expected none, auto or one of {', '.join(ALGORITHMS)}"
        )
    root = Path(args.dir)
    train = root / "train" if (root / "train").is_dir() and (root / "eval").is_dir() else root
    files = shard_files(train)
    depth = args.max_per_pack if args.packing != "none" else 1
    t = time.perf_counter()
    summary, idx = ensure_index(
        files, [0] * len(files), PackSettings(args.max_seq_len, args.packing, depth, args.seed)
    )
    packs, tokens = int(summary.packs.sum()), int(summary.tokens.sum())
    print(
        json.dumps(
            {
                "shards": len(files),
                "index": str(idx),
                "sequences": int(summary.sequences.sum()),
                "packs": packs,
                "efficiency": round(tokens / max(packs * args.max_seq_len, 1), 5),
                "seconds": round(time.perf_counter() - t, 2),
            }
        )
    )
    return 0


def _prepare_fashion_mnist(args: argparse.Namespace) -> int:
    from scaleout.families.resnet.data import fashion

    t = time.perf_counter()
    out = args.out or fashion.DEFAULT_OUT
    counts = fashion.prepare(out, args.source or fashion.SOURCE_DIR)
    print(
        f"{out}: {counts['train']} train and {counts['val']} val PNGs in "
        f"{len(counts['classes'])} classes ({time.perf_counter() - t:.1f} s)"
    )
    return 0
