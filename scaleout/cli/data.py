"""scaleout data: MLPerf BERT shards (write them from the offline corpus, index them for lazy
training) and image data (ImageNet as an ImageFolder, images as tar shards, Fashion-MNIST written
once as PNG class folders: the ResNet CPU time-to-train data)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NAME = "data"
ORDER = 42
HELP = (
    "MLPerf BERT shards: 'make-shards', 'index', 'pack' (packing strategies); images: "
    "'prepare-imagenet' (ILSVRC2012 -> "
    "checked ImageFolder), 'make-image-shards' (ImageFolder -> tar shards), "
    "'prepare-fashion-mnist' (PNG class folders for ResNet)"
)
DESCRIPTION = """\
scaleout data make-shards DIR --shards N [--layout fixed|varlength|packed] [--max-seq-len 128] ...
scaleout data index DIR [--max-seq-len 512] [--packing lphp] [--max-per-pack 3] [--seed 0]
scaleout data prepare-imagenet OUT --train DIR --val DIR [--labels FILE [--meta meta.mat]]
scaleout data make-image-shards IMAGEFOLDER OUT [--shard-mb 256]
scaleout data prepare-fashion-mnist [--out runs/data/fashion-mnist] [--source DIR]
scaleout data pack [HISTOGRAM | --lengths FILE] --max-len 512 --max-per-pack 3 [--packing a,b]

make-shards: N training shards (DIR/train/part_0000i_of_0000N.hdf5) and an eval file (DIR/eval/) in
the MLPerf BERT HDF5 format -- input_ids, input_mask, segment_ids, masked_lm_positions,
masked_lm_ids, next_sentence_labels with the reference's dtypes and shapes (--layout fixed), or
NVIDIA's variable-length (v1.0+) or packed (v2.0+) layouts -- from the offline pydoc/stdlib corpus,
plus DIR/vocab.txt. Train on it with data.source=wikipedia data.path=DIR.

index: builds the per-shard length index and packs that lazy training reads
(DIR/train/.scaleout-index); training builds it itself when missing (in parallel over the ranks),
this does it ahead of time.

prepare-imagenet: the ILSVRC2012 download as OUT/train/<wnid>/ and OUT/val/<wnid>/
(docs/data-layouts.md). --train: class folders, or the 1,000 n*.tar that ILSVRC2012_img_train.tar
holds (unpacked into OUT/train/<wnid>/). --val: the flat ILSVRC2012_val_*.JPEG folder, filed into
class folders with hard links (symlinks across file systems; nothing is copied) using --labels: the
devkit's ILSVRC2012_validation_ground_truth.txt plus --meta (the devkit's meta.mat, needs scipy),
Kaggle's LOC_val_solution.csv, or a text file of '<file> <wnid>' lines. Then checks 1,000 classes,
1,281,167 train and 50,000 val images (--expect-* change them) and that val's classes are train's,
and builds the file index training reads. Train on it with data.source=imagenet data.path=OUT.

make-image-shards: an ImageFolder (IMAGEFOLDER/train, /val) as tar shards in the webdataset layout:
OUT/train-000000.tar ... and OUT/val-000000.tar ..., members <key>.jpg + <key>.cls, OUT/classes.txt,
about --shard-mb MB each, with their member index. Train on it with data.path=OUT (data.format=auto
finds the shards); each node reads only its own shards (i % nodes == node).

prepare-fashion-mnist: Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist/*.gz)
written once as 28x28 PNGs into OUT/train/<class>/<i>.png (60,000) and OUT/val/<class>/<i>.png
(10,000), classes 0_tshirt ... 9_ankle_boot; a marker file makes a second call instant. Train on it
with data.source=images data.path=OUT (configs/resnet_cpu.yaml; its data.prepare: fashion-mnist
runs this on first use).

examples:
  scaleout data prepare-imagenet /data/imagenet --train /raw/train --val /raw/val \
    --labels /raw/LOC_val_solution.csv
  scaleout data make-image-shards /data/imagenet /data/imagenet-shards --shard-mb 256
  scaleout data make-shards /tmp/shards --shards 8
  scaleout data make-shards /tmp/packed --shards 4 --layout packed --max-seq-len 128
  scaleout data index /tmp/shards --max-seq-len 128 --packing lphp
  scaleout data prepare-fashion-mnist --out runs/data/fashion-mnist
  scaleout launch --nproc-per-node 2 -- scaleout train bert_tiny_cpu data.source=wikipedia
  data.path=/tmp/shards
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from scaleout.cli import grouped

    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    for mod in grouped(NAME):  # data tools kept in their own module: pack
        sp = sub.add_parser(
            mod.NAME,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(sp)
        sp.set_defaults(_data_run=mod.run, _name=f"{NAME} {mod.NAME}")  # errors name it
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
    m.add_argument("--seed", type=int, default=0, help="seed of the masking and pairing (0)")
    i = sub.add_parser("index", help="build the lazy-training index of a shard directory")
    i.add_argument("dir", help="shard directory (with train/ and eval/, or the shards themselves)")
    i.add_argument(
        "--max-seq-len", type=int, default=512, help="tokens per sequence, data.max_seq_len (512)"
    )
    i.add_argument(
        "--packing",
        default="lphp",
        help="packing algorithm: none, spfhp, lpfhp, nnlshp, lphp or auto",
    )
    i.add_argument("--max-per-pack", type=int, default=3, help="sequences per packed row (3)")
    i.add_argument(
        "--seed", type=int, default=0, help="seed: data.seed of the runs that will read it"
    )
    pi = sub.add_parser(
        "prepare-imagenet",
        help="ILSVRC2012 train/val -> a checked ImageFolder (val filed by its labels)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pi.add_argument("out", help="output folder (OUT/train, OUT/val)")
    pi.add_argument("--train", required=True, help="class folders, or the n*.tar class tars")
    pi.add_argument("--val", required=True, help="flat ILSVRC2012_val_*.JPEG folder")
    pi.add_argument(
        "--labels",
        help="val labels: ILSVRC2012_validation_ground_truth.txt (with --meta), "
        "LOC_val_solution.csv, or '<file> <wnid>' lines",
    )
    pi.add_argument("--meta", help="the devkit's meta.mat (ILSVRC2012 ID -> wnid)")
    pi.add_argument("--expect-classes", type=int, default=1000, help="default 1000")
    pi.add_argument(
        "--expect-train", type=int, default=None, help="default: ImageNet-1k's training images"
    )
    pi.add_argument("--expect-val", type=int, default=50_000, help="default 50000")
    ms = sub.add_parser(
        "make-image-shards",
        help="ImageFolder -> tar shards (webdataset layout) with their index",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ms.add_argument("src", help="ImageFolder root (src/train/<class>/..., src/val/<class>/...)")
    ms.add_argument("out", help="output folder for <split>-NNNNNN.tar")
    ms.add_argument("--shard-mb", type=float, default=256.0, help="shard size in MB (default 256)")
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
    if getattr(args, "_data_run", None):
        return int(args._data_run(args) or 0)
    if args.action == "prepare-fashion-mnist":
        return _prepare_fashion_mnist(args)
    if args.action == "prepare-imagenet":
        from scaleout.families.resnet import IMAGENET_TRAIN_IMAGES
        from scaleout.families.resnet.data.prepare import (  # deferred: PIL/torch for this action
            prepare_imagenet,
        )

        summary = prepare_imagenet(
            args.out,
            args.train,
            args.val,
            args.labels,
            args.meta,
            args.expect_classes,
            IMAGENET_TRAIN_IMAGES if args.expect_train is None else args.expect_train,
            args.expect_val,
            progress=lambda line: print(line, flush=True),
        )
        print(json.dumps(summary))
        return 0
    if args.action == "make-image-shards":
        from scaleout.families.resnet.data.shards import (  # deferred: PIL/torch for this action
            write_shards,
        )

        t = time.perf_counter()
        summary = write_shards(
            args.src, args.out, args.shard_mb, progress=lambda line: print(line, flush=True)
        )
        print(json.dumps({**summary, "seconds": round(time.perf_counter() - t, 2)}))
        return 0
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
