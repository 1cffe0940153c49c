"""MLPerf BERT shards on real files written by `scaleout data make-shards`: the exact HDF5
format, the three layouts (reference fixed, NVIDIA varlength and packed), the per-shard index,
lazy per-rank reading (every sequence once per epoch, only the shards a step needs opened, exact
resume), host memory that does not grow with the number of shards, and `scaleout train` end to
end on them."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import h5py  # the test extra installs it: missing is a failure, not a skip
import numpy as np
import pytest

from scaleout.cli import main as cli_main
from scaleout.data.corpus import pydoc_documents
from scaleout.errors import UserError
from scaleout.families.bert.data.make_shards import make_shards
from scaleout.families.bert.data.shard_format import ShardReader, shard_files

SEQ, PRED, VOCAB = 64, 10, 1024


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The same corpus samples written in the three layouts (4 training shards each)."""
    from scaleout.families.bert.data.pretrain import build_pretraining_data

    root, cache, docs = (
        tmp_path_factory.mktemp("shards"),
        str(tmp_path_factory.mktemp("cache")),
        pydoc_documents(),
    )
    kw = dict(
        max_seq_len=SEQ,
        max_predictions=PRED,
        vocab_size=VOCAB,
        dupe_factor=2,
        seed=3,
        cache=cache,
        docs=docs,
    )
    for layout in ("fixed", "varlength", "packed"):
        make_shards(root / layout, 4, layout, packing="lpfhp", **kw)
    data = build_pretraining_data(
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        max_predictions=PRED,
        dupe_factor=2,
        seed=3,
        cache=cache,
        docs=docs,
    )
    return root, data


def _key(tokens, positions, labels, nsp_is_next) -> tuple:
    return (
        bytes(np.asarray(tokens, np.int32)),
        bytes(np.asarray(positions, np.int32)),
        bytes(np.asarray(labels, np.int32)),
        int(nsp_is_next),
    )


@pytest.mark.full_system
def test_make_shards_writes_the_reference_format(tmp_path, capsys):
    """CLI: N shards + eval file with exactly the reference's fields, dtypes and shapes (NVIDIA's
    create_pretraining_data.py HDF5 writer: i4/i1/i1/i4/i4/i1), sizes balanced like
    chop_hdf5_files.py."""
    assert (
        cli_main(
            [
                "data",
                "make-shards",
                str(tmp_path),
                "--shards",
                "3",
                "--max-seq-len",
                str(SEQ),
                "--max-predictions",
                str(PRED),
                "--vocab-size",
                str(VOCAB),
                "--dupe-factor",
                "1",
            ]
        )
        == 0
    )
    assert "3 fixed training shards" in capsys.readouterr().out
    files = sorted((tmp_path / "train").iterdir())
    assert [f.name for f in files] == [f"part_{i:05d}_of_00003.hdf5" for i in range(3)]
    want = {
        "input_ids": ("int32", SEQ),
        "input_mask": ("int8", SEQ),
        "segment_ids": ("int8", SEQ),
        "masked_lm_positions": ("int32", PRED),
        "masked_lm_ids": ("int32", PRED),
        "next_sentence_labels": ("int8", None),
    }
    sizes = []
    for f in [*files, *sorted((tmp_path / "eval").iterdir())]:
        with h5py.File(f, "r") as h:
            assert set(h.keys()) == set(want)
            n = h["input_ids"].shape[0]
            for k, (dt, width) in want.items():
                assert str(h[k].dtype) == dt and h[k].shape == ((n, width) if width else (n,)), (
                    f,
                    k,
                )
            mask = h["input_mask"][:]
            assert set(np.unique(mask)) <= {0, 1} and (mask[:, 0] == 1).all()
            assert (np.diff(mask.astype(int), axis=1) <= 0).all()  # real tokens first, then padding
            assert (h["masked_lm_positions"][:] < mask.sum(1, keepdims=True)).all()
            if f.parent.name == "train":
                sizes.append(n)
    assert max(sizes) - min(sizes) <= 1
    vocab = (tmp_path / "vocab.txt").read_text().split("\n")
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and len(vocab) - 1 == VOCAB
    assert (
        cli_main(["data", "make-shards", str(tmp_path / "x"), "--shards", "2", "--layout", "zip"])
        == 2
    )
    assert "--layout='zip'" in capsys.readouterr().err


@pytest.mark.multi_process
def test_three_layouts_read_back_the_same_sequences(built):
    """Reference fixed, NVIDIA varlength and NVIDIA packed (v2.0) files hold the corpus samples
    exactly; the fixed file row by row, the packed one as packs that together hold every sequence
    once."""
    root, data = built
    originals = [
        _key(s.input_ids, s.masked_positions, s.masked_labels, 1 - s.nsp_label) for s in data.train
    ]
    for layout in ("fixed", "varlength", "packed"):
        got = []
        for f in shard_files(root / layout / "train"):
            r = ShardReader(f)
            assert r.layout == layout
            rows = r.read(np.arange(r.rows)[::-1])[::-1]  # any order; read back in file order
            r.close()
            if layout == "packed":
                assert (
                    max(len(x) for x in rows) <= 3
                    and sum(sum(len(s) for s in x) > SEQ for x in rows) == 0
                )
            got += [
                _key(s.tokens, s.mlm_positions, s.mlm_labels, s.nsp_label) for x in rows for s in x
            ]
        if layout == "packed":
            assert sorted(got) == sorted(originals)
        else:
            assert got == originals
    r = ShardReader(shard_files(root / "fixed" / "train")[0])
    with pytest.raises(UserError, match="outside 0.."):
        r.read([r.rows])


def _stream(root, world, rank, packing="lpfhp", batch=12):
    from scaleout.config import load_config
    from scaleout.families.bert.data.shard_source import open_shards

    cfg = load_config(
        "bert_tiny_cpu",
        [
            "data.source=wikipedia",
            f"data.path={root}",
            f"data.max_seq_len={SEQ}",
            f"data.max_predictions={PRED}",
            f"data.packing={packing}",
            f"train.global_batch={batch}",
            "data.eval_samples=40",
        ],
    )
    return open_shards(cfg, rank, world)


@pytest.mark.multi_process
@pytest.mark.parametrize("layout", ["fixed", "packed"])
def test_lazy_stream_every_sequence_once_per_epoch_on_every_layout(built, layout):
    """3 ranks (each its own stream, as in separate processes): over one epoch the ranks' rows
    hold every training sequence exactly once; each rank's share per step is its slice;
    global_counts (what the MLPerf samples count uses, no communication) equals the sum of what
    the ranks got."""
    root, data = built
    world, batch = 3, 12
    streams = [_stream(root / layout, world, r, batch=batch).stream for r in range(world)]
    total = streams[0].total
    seen, step = [], 0
    while step * batch < total:
        per_rank = [s.batches(step * batch, 1)[0] for s in streams]
        n, t = streams[0].global_counts(step * batch)
        assert n == sum(b[1] for b in per_rank) and t == sum(b[2] for b in per_rank)
        for b, _, _ in per_rank:
            for row in range(b["input_ids"].shape[0]):
                seen += _sequences_of_row(b, row)
        step += 1
    whole = [
        _key(s.input_ids, s.masked_positions, s.masked_labels, 1 - s.nsp_label) for s in data.train
    ]
    first_epoch = seen[: len(whole)]
    assert sorted(first_epoch) == sorted(whole)  # exactly once, nothing else
    assert first_epoch != whole  # shuffled


def _sequences_of_row(b, row) -> list[tuple]:
    """Decode one packed row of a model batch back into (tokens, masked positions, labels, nsp)
    per sequence."""
    ids, sid = b["input_ids"][row].numpy(), b["seq_ids"][row].numpy()
    pos, lab = b["mlm_positions"][row].numpy(), b["mlm_labels"][row].numpy()
    nsp_pos, nsp_lab = b["nsp_positions"][row].numpy(), b["nsp_labels"][row].numpy()
    out = []
    for j in range(1, int(sid.max(initial=0)) + 1):
        where = np.nonzero(sid == j)[0]
        start = int(where[0])
        keep = (lab != -100) & (pos >= start) & (pos <= where[-1])
        truth = lab.copy()
        tokens = ids[where].copy()
        out.append(
            _key(tokens, pos[keep] - start, truth[keep], nsp_lab[list(nsp_pos).index(start)])
        )
    return out


@pytest.mark.multi_process
def test_a_rank_opens_only_the_shards_of_its_steps_and_resumes_exactly(built):
    """A step reads only the shard(s) its rows are in (the LRU holds <= 2 open files, <= 3
    shards' packs); a stream pickled (prefetch workers) or rebuilt (a resumed run) gives the same
    batches at a position."""
    from scaleout.families.bert.data.shard_source import OPEN_FILES, PACKS_CACHE

    root, _ = built
    stream = _stream(root / "fixed", 2, 1).stream
    for step in (0, 7, 33):
        stream.batches(step * 12, 2)
        needed = {j for j, _ in stream.segments(step * 12 + 6, 6)}
        assert needed <= set(stream._readers) and len(stream._readers) <= OPEN_FILES
        assert len(stream._packs) <= PACKS_CACHE
    assert len(pickle.dumps(stream)) < 4096  # paths and per-shard counts only
    again = pickle.loads(pickle.dumps(stream))
    fresh = _stream(root / "fixed", 2, 1).stream
    for pos in (5 * 12, 1000 * 12):  # the second one is several epochs in
        a, b, c = stream.batches(pos, 2), again.batches(pos, 2), fresh.batches(pos, 2)
        for x, y, z in zip(a, b, c, strict=True):
            assert all((x[0][k] == y[0][k]).all() and (x[0][k] == z[0][k]).all() for k in x[0])


@pytest.mark.multi_process
def test_index_is_built_in_parallel_and_shared(built):
    """2 real ranks (gloo): each indexes its half of the shards, rank 0 writes one summary, both
    read the same counts; the cache sits beside the data."""
    from distutil import run_dist

    root, _ = built
    src = root / "varlength"
    out = run_dist(_open_on_rank, nnodes=1, nproc_per_node=2, args=(str(src),))
    assert out[0] == out[1]
    idx = src / "train" / ".scaleout-index"
    assert len(list(idx.glob("summary-*.npz"))) == 1 and len(list(idx.glob("*.len.npy"))) == 4


def _open_on_rank(world, path):
    from scaleout.config import load_config
    from scaleout.families.bert.data.shard_source import open_shards

    cfg = load_config(
        "bert_tiny_cpu",
        [
            "data.source=wikipedia",
            f"data.path={path}",
            f"data.max_seq_len={SEQ}",
            f"data.max_predictions={PRED}",
            "train.global_batch=8",
        ],
    )
    d = open_shards(cfg, world.rank, world.world_size, world.barrier)
    return d.stream.counts.tolist(), len(d.eval)


RSS_SCRIPT = """import sys
import h5py, numpy, torch  # noqa: F401 -- every import first
from scaleout.config import load_config
from scaleout.families.bert.data import bert_sources, shard_source
path, mode = sys.argv[1], sys.argv[2]
if mode == "eager":  # what every rank did before: every sequence of every shard as Python objects
    data = bert_sources.load_shards(path + "/train")
else:
    cfg = load_config("bert_tiny_cpu", ["data.source=wikipedia", "data.path=" + path,
    "data.max_seq_len=128",
                                        "data.max_predictions=20", "train.global_batch=16",
                                        "data.eval_samples=32"])
    d = shard_source.open_shards(cfg, 0, 2)
    for step in range(0, 400, 40):
        d.stream.batches(step * 16, 1)
# anonymous resident memory (heap): file-backed library pages are left out, their count follows
# the page cache of this shared machine (fault-around), not the data
print([int(x.split()[1]) / 1024 for x in open("/proc/self/status") if x.startswith("RssAnon")][0])
"""


# sequences per shard: 8 shards' eager records are far more than 15 % of a rank's base RSS
ROWS = 10_000


@pytest.mark.full_system
def test_host_memory_does_not_grow_with_shards(tmp_path):
    """A rank's resident heap after its data path with 8 shards <= 1.15x with 2 (same shard
    size); the eager load the trainer did before grows past that bar on the same files (so this
    test fails on the old code path). `scaleout bench shards` measures the peak RSS (ru_maxrss)
    through full training runs."""
    from scaleout.families.bert.data.bert_sources import synthetic_samples
    from scaleout.families.bert.data.shard_format import write_shard

    for n in (2, 8):
        (tmp_path / f"s{n}" / "train").mkdir(parents=True)
        (tmp_path / f"s{n}" / "eval").mkdir()
        for i in range(n):
            rows = [[s] for s in synthetic_samples(ROWS, 128, 4096, 20, seed=i)]
            write_shard(tmp_path / f"s{n}" / "train" / f"part_{i}.hdf5", rows, "fixed", 128, 20)
        write_shard(
            tmp_path / f"s{n}" / "eval" / "e.hdf5",
            [[s] for s in synthetic_samples(64, 128, 4096, 20)],
            "fixed",
            128,
            20,
        )

    def rss(n: int, mode: str) -> float:
        r = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / f"s{n}"), mode],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])},
        )
        return float(r.stdout.split()[-1])

    rss(8, "lazy")  # build the index first: the bar is about the steady state of every later start
    rss(2, "lazy")
    lazy = {n: rss(n, "lazy") for n in (2, 8)}
    eager = {n: rss(n, "eager") for n in (2, 8)}
    assert lazy[8] <= 1.15 * lazy[2], lazy
    assert eager[8] > 1.15 * eager[2], eager


@pytest.mark.full_system
def test_train_on_make_shards_output_end_to_end(built, tmp_path):
    """`scaleout train` on 2 ranks (a prefetch worker each) from the packed (NVIDIA v2.0) files:
    MLPerf log passes the real checker, global_batch_size counts sequences (rows x integer
    packing rate), evaluation starts at train.eval_start_step then every train.eval_every,
    report.json has the peak RSS per rank."""
    from scaleout.telemetry.mlperf import check_compliance

    root, _ = built
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "scaleout",
        "launch",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--",
        "scaleout",
        "train",
        "bert_tiny_cpu",
        "data.source=wikipedia",
        f"data.path={root / 'packed'}",
        f"data.max_seq_len={SEQ}",
        f"data.max_predictions={PRED}",
        f"model.bert.vocab_size={VOCAB}",
        "train.global_batch=16",
        "train.max_steps=7",
        "train.eval_start_step=3",
        "train.eval_every=2",
        "data.eval_samples=40",
        "optim.warmup_steps=2",
        "optim.total_steps=8",
        # the lazy stream is pickled into a prefetch worker, which opens the files itself
        "data.num_workers=1",
        "train.progress=false",
        f"train.output_dir={out}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["peak_rss_mib_per_rank_max"] > 50 and report["task"]["packing"]["per"] == "shard"
    assert (
        report["flops_per_sample"] > 0 and 0 < report["mfu"] <= 1
    )  # FLOPs counted from the shards' batches
    lines = [
        json.loads(x.split(":::MLLOG ", 1)[1])
        for x in (out / "mlperf.log").read_text().splitlines()
    ]
    ev = {x["key"]: x for x in lines}
    rate = round(report["task"]["packing"]["sequences_per_row"])
    assert ev["global_batch_size"]["value"] == 16 * rate
    steps_at_eval = [x["metadata"]["samples_count"] for x in lines if x["key"] == "eval_accuracy"]
    assert len(steps_at_eval) == 3  # after steps 3, 5 and 7 (the last); from step 2 it would be 4
    ok, text = check_compliance(out / "mlperf.log", "bert", quality_target=report["achieved"])
    assert ok, text[-3000:]


def _open_or_error(world, path, max_len, max_pred):
    from scaleout.config import load_config
    from scaleout.errors import ConfigError
    from scaleout.families.bert.data.shard_source import open_shards

    cfg = load_config(
        "bert_tiny_cpu",
        [
            "data.source=wikipedia",
            f"data.path={path}",
            f"data.max_seq_len={max_len}",
            f"data.max_predictions={max_pred}",
            "train.global_batch=8",
        ],
    )
    try:
        open_shards(cfg, world.rank, world.world_size, world.barrier)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.multi_process
def test_bad_shards_stop_every_rank_with_one_line(built):
    """A shard with rows longer than data.max_seq_len, found while rank 1 indexes it, stops
    *both* ranks with the same one-line error (not rank 1 failing while rank 0 waits at the
    barrier); more mask slots in the file than data.max_predictions is refused before any
    indexing."""
    from distutil import run_dist

    root, _ = built
    out = run_dist(
        _open_or_error, nnodes=1, nproc_per_node=2, args=(str(root / "varlength"), 32, PRED)
    )
    assert out[0] == out[1] and "data.max_seq_len=32 but part_" in out[0] and "\n" not in out[0]
    out = run_dist(_open_or_error, nnodes=1, nproc_per_node=2, args=(str(root / "fixed"), SEQ, 5))
    assert (
        out[0] == out[1]
        and f"data.max_predictions=5 but part_00000_of_00004.hdf5 has {PRED} mask slots" in out[0]
    )


@pytest.mark.multi_process
def test_one_folder_holds_out_its_first_sequences_for_eval(built):
    """data.path without train/ + eval/: the first data.eval_samples sequences (sorted files, row
    order) are the eval set, and training never sees them."""
    root, data = built
    d = _stream(root / "fixed" / "train", 1, 0, packing="none", batch=8)
    assert len(d.eval) == 40
    held = [
        _key(s.input_ids, s.masked_positions, s.masked_labels, 1 - s.nsp_label)
        for s in data.train[:40]
    ]
    assert [
        _key(q.tokens, q.mlm_positions, q.mlm_labels, q.nsp_label)
        for q in (d.eval[i] for i in range(40))
    ] == held
    assert d.stream.total == len(data.train) - 40
    seen = []
    for step in range(-(-d.stream.total // 8)):
        b = d.stream.batches(step * 8, 1)[0][0]
        seen += [k for row in range(b["input_ids"].shape[0]) for k in _sequences_of_row(b, row)]
    assert not set(held) & set(seen[: d.stream.total])


def _lane_streams(world: int, shards: int, per_rank: int, seed: int):
    """Every rank's stream over ``shards`` balanced shards (pack counts within 3 %, as
    chop_hdf5_files.py balances them): the order is a pure function, no file is opened."""
    from scaleout.families.bert.data.shard_index import PackSettings
    from scaleout.families.bert.data.shard_source import ShardStream

    counts = np.random.default_rng(seed).integers(97, 104, shards)
    files = [Path(f"part_{j}.hdf5") for j in range(shards)]
    return [
        ShardStream(
            files,
            [0] * shards,
            counts,
            PackSettings(SEQ, "none", 1),
            Path("index"),
            world * per_rank,
            r,
            world,
            PRED,
            1,
        )
        for r in range(world)
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    "world,shards,per_rank",
    [(8, 16, 2), (8, 8, 2), (16, 16, 4), (32, 40, 2), (12, 5, 4), (64, 10, 2)],
)
def test_ranks_read_different_files_at_each_step(world, shards, per_rank):
    """Review gpu-day-one, finding 7: read in shard order, all ranks read the same one or two
    files at every step. Over 3 epochs, at every step no file is read by more than ceil(ranks /
    shards) + 1 ranks (twice that at the one step per epoch whose positions straddle two epochs,
    whose shard orders differ); every pack is still read exactly once per epoch, and the order is
    a pure function (a second set of streams gives the same runs)."""
    streams = _lane_streams(world, shards, per_rank, seed=world + shards)
    batch, total = world * per_rank, streams[0].total
    bound = -(-world // shards) + 1
    epochs: dict[int, list[tuple[int, int]]] = {}
    for step in range(-(-3 * total // batch)):
        readers: dict[int, int] = {}
        for r, s in enumerate(streams):
            start = step * batch + r * per_rank
            runs = s.segments(start, per_rank)
            for j in {j for j, _ in runs}:
                readers[j] = readers.get(j, 0) + 1
            flat = [(j, int(q)) for j, which in runs for q in which]
            for i, item in enumerate(flat):
                epochs.setdefault((start + i) // total, []).append(item)
        straddles = step * batch // total != ((step + 1) * batch - 1) // total
        assert max(readers.values()) <= bound * (2 if straddles else 1), (step, readers)
    whole = sorted((j, q) for j in range(shards) for q in range(int(streams[0].counts[j])))
    for e in range(3):
        assert sorted(epochs[e]) == whole  # every pack of every shard, once
    again = _lane_streams(world, shards, per_rank, seed=world + shards)
    for pos in (0, 5 * batch + per_rank, total + 3):
        a, b = streams[1].segments(pos, per_rank), again[1].segments(pos, per_rank)
        assert [(j, w.tolist()) for j, w in a] == [(j, w.tolist()) for j, w in b]


def _count_fs_calls_at_start(world, path):
    """open_shards twice on this rank (the first builds the index); the second's file-system
    metadata calls and opens, counted at the Python entry points every path goes through
    (Path.stat/is_file/iterdir and np.load all end in these)."""
    import builtins

    from scaleout.families.bert.data.shard_source import open_shards
    from scaleout.families.bert.task import TorchCollectives

    cfg = _small_shard_config(path, "train.max_steps=4")
    comm = TorchCollectives(world)
    open_shards(cfg, world.rank, world.world_size, world.barrier, comm)
    names = ("stat", "lstat", "listdir", "scandir", "access")
    real = {n: getattr(os, n) for n in names} | {"open": builtins.open}
    calls: list[str] = []

    def counted(name):
        def call(*a, **k):
            calls.append(name)
            return real[name](*a, **k)

        return call

    try:
        for n in names:
            setattr(os, n, counted(n))
        builtins.open = counted("open")
        data = open_shards(cfg, world.rank, world.world_size, world.barrier, comm)
    finally:
        for n in names:
            setattr(os, n, real[n])
        builtins.open = real["open"]
    return len(calls), data.stream.counts.tolist(), data.step_counts.tolist()


@pytest.mark.multi_process
def test_only_rank_0_lists_and_stats_the_shards_at_start(tmp_path):
    """Review gpu-day-one, finding 10: every rank statted every shard on every start (21 M stats
    at 2,048 ranks x 4,320 shards). 2 real ranks (gloo), warm index, 24 training shards: rank 0
    lists and stats them (>= 24 calls), rank 1 gets the plan in one broadcast and makes O(1)
    calls (5 per shard its first steps read, for the per-step counts: 2 shards here; before, 74
    on each rank, growing with the shards); both see the same counts,
    and the all-reduced per-step counts equal the single-process global_counts."""
    from distutil import run_dist
    from telemetry.test_mlperf_timing import _write_fixed_shard  # tests/ is on sys.path

    rng = np.random.default_rng(0)
    for split, files in (("train", 24), ("eval", 1)):
        (tmp_path / split).mkdir()
        for j in range(files):
            _write_fixed_shard(tmp_path / split / f"part-{j:02d}.npz", 12, 32, 5, rng)
    out = run_dist(_count_fs_calls_at_start, nnodes=1, nproc_per_node=2, args=(str(tmp_path),))
    (calls0, counts0, table0), (calls1, counts1, table1) = out
    assert calls0 >= 24 and calls1 <= 12, (calls0, calls1)  # 74 and 74 before
    assert counts0 == counts1 and table0 == table1
    streams = [
        _stream_at(tmp_path, r) for r in range(2)
    ]  # no process group: each rank lists for itself
    assert table0 == [list(streams[0].global_counts(step * 8)) for step in range(4)]


def _small_shard_config(path, *extra: str):
    """bert_tiny_cpu reading the small unpacked shards at ``path`` (8 sequences a step)."""
    from scaleout.config import load_config

    return load_config(
        "bert_tiny_cpu",
        [
            "data.source=wikipedia",
            f"data.path={path}",
            "data.max_seq_len=32",
            "data.max_predictions=5",
            "data.packing=none",
            "data.eval_samples=8",
            "train.global_batch=8",
            *extra,
        ],
    )


def _stream_at(path, rank):
    from scaleout.families.bert.data.shard_source import open_shards

    cfg = _small_shard_config(path)
    return open_shards(cfg, rank, 2).stream
