"""Checkpoints: round trip, corruption/truncation fall-back, keep-N, bitwise-exact resume, the
memory a save and a load take, and what crosses ranks during them."""

from __future__ import annotations

import gc
import logging
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from scaleout.checkpoint import Checkpointer, CorruptCheckpoint, decode, encode
from scaleout.data.sampler import ShardedSampler
from scaleout.errors import UserError
from scaleout.train.rng import seed_step


@pytest.mark.unit
def test_round_trip_keep_n_and_weights_only(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    model = nn.Linear(3, 2)
    for step in (10, 20, 30):
        ck.save(step, {"model": model.state_dict(), "data_position": step * 8})
    assert [s for s, _ in ck.list()] == [20, 30]
    state, path = ck.load_latest()
    assert path.name == "ckpt-00000030.pt" and state["step"] == 30 and state["data_position"] == 240
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert not list(tmp_path.glob("*.tmp"))
    # non-zero ranks write nothing
    assert (
        Checkpointer(tmp_path / "r1", rank=1).save(1, {"x": 1}) is None
        and not (tmp_path / "r1").exists()
    )
    # weights_only=True really is used: an arbitrary object is refused
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        decode(encode({"bad": Checkpointer}))
    with pytest.raises(UserError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)


@pytest.mark.unit
def test_corrupted_or_truncated_latest_falls_back(tmp_path, caplog):
    ck = Checkpointer(tmp_path, keep=3)
    for step in (1, 2, 3):
        ck.save(step, {"w": torch.full((100,), float(step))})
    p3, p2 = ck.path(3), ck.path(2)
    blob = bytearray(p3.read_bytes())
    blob[-10] ^= 0xFF  # flip one bit of the payload
    p3.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        decode(p3.read_bytes())
    p2.write_bytes(p2.read_bytes()[:-50])  # truncated write
    with caplog.at_level(logging.WARNING, logger="scaleout.checkpoint"):
        state, path = ck.load_latest()
    assert path == ck.path(1) and torch.equal(state["w"], torch.full((100,), 1.0))
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "ckpt-00000003.pt" in msgs and "checksum" in msgs
    assert "ckpt-00000002.pt" in msgs and "truncated" in msgs
    p3.write_bytes(b"garbage")
    ck.path(1).write_bytes(b"")
    assert ck.load_latest() is None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.3)  # consumes the torch RNG every step

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _train(
    steps: int, ckpt_dir, stop_at: int | None = None, resume: bool = False, reseed: bool = True
) -> dict:
    """A real loop: model + AdamW + LR schedule + sampler + python/numpy/torch randomness, each
    step's streams seeded from (seed, step, rank) as the trainer does (scaleout/train/rng.py)."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    data = torch.randn(200, 8, generator=torch.Generator().manual_seed(9))
    target = torch.randint(0, 4, (200,), generator=torch.Generator().manual_seed(9))
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97**s)
    sampler = ShardedSampler(200, 16, seed=3)
    ck = Checkpointer(ckpt_dir, keep=2)
    step, position = 0, 0
    if resume:
        # perturb every RNG, so only the per-step seeding can reproduce the run
        torch.manual_seed(123)
        np.random.seed(123)
        random.seed(123)
        state, _ = ck.load_latest()
        assert "rng" not in state  # a checkpoint holds no RNG state
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        step, position = state["step"], state["data_position"]
    while step < steps:
        if reseed or step == 0:
            seed_step(7, step, 0)
        idx = sampler.local_indices(position)
        x = data[idx] + 0.01 * torch.from_numpy(np.random.randn(len(idx), 8).astype(np.float32))
        if random.random() < 0.5:  # python RNG in the loop (e.g. a data augmentation choice)
            x = x.flip(0).flip(0) * 1.0
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), target[idx]).backward()
        opt.step()
        sched.step()
        step, position = step + 1, position + sampler.global_batch
        if stop_at is not None and step == stop_at:
            ck.save(
                step,
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "schedule": sched.state_dict(),
                    "data_position": position,
                },
            )
            return {}
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.full_system
def test_bitwise_resume(tmp_path):
    """Interrupted after 13 of 30 steps and resumed, the weights equal the uninterrupted run's
    bit for bit, though the checkpoint holds no RNG state: each step seeds its python, numpy and
    torch streams from (seed, step, rank), so the resumed steps draw what the uninterrupted ones
    drew."""
    torch.use_deterministic_algorithms(True)
    try:
        full = _train(30, tmp_path / "a")
        _train(
            30, tmp_path / "b", stop_at=13
        )  # "interrupted" after 13 steps (crosses an epoch: 13*16 > 200)
        resumed = _train(30, tmp_path / "b", resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # and the check is sharp: the same runs seeded once at the start (streams carried on from
    # step to step, as before) diverge on a resume
    torch.use_deterministic_algorithms(True)
    try:
        once = _train(30, tmp_path / "c", reseed=False)
        _train(30, tmp_path / "d", stop_at=13, reseed=False)
        wrong = _train(30, tmp_path / "d", resume=True, reseed=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not all(torch.equal(once[k], wrong[k]) for k in once)


def _status(key: str) -> int:
    """A /proc/self/status memory figure in bytes (VmRSS: now; VmHWM: the peak since reset)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _peak_extra(fn) -> int:
    """Bytes the process's resident set grew to above where it stood, while ``fn()`` ran."""
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)
    fn()
    return _status("VmHWM") - base


@pytest.mark.unit
def test_save_and_load_hold_at_most_half_the_state_besides_it(tmp_path):
    """A 64 MiB state: its save streams to the file (peak extra memory <= 0.5x the state, so the
    save's peak is <= 1.5x the state) and its load holds the loaded state and little more (<=
    1.5x). The save used to build the payload in a BytesIO, copy it out and prepend the header
    (another copy): 2-3x extra; the load read the file, sliced the payload (a copy) and
    unpickled it: ~3x. At BERT-large's 4 GB state with LAMB that was ~12 GB on rank 0."""
    size = 64 << 20
    state = {"model": {f"w{i}": torch.randn(2 << 20) for i in range(8)}, "step": 1}
    assert sum(t.numel() * 4 for t in state["model"].values()) == size
    ck = Checkpointer(tmp_path, keep=1)
    ck.save(1, {"w": torch.ones(1000)})  # code paths warm (imports, the zip writer)
    ck.load_latest()
    saved = _peak_extra(lambda: ck.save(2, state))
    box: list = []
    loaded = _peak_extra(lambda: box.append(ck.load_latest()))
    ((got, path),) = box
    assert path == ck.path(2) and all(
        torch.equal(got["model"][k], v) for k, v in state["model"].items()
    )
    assert saved <= 0.5 * size, f"save: {saved / 2**20:.0f} MiB extra for a 64 MiB state"
    assert loaded <= 1.5 * size, f"load: {loaded / 2**20:.0f} MiB for a 64 MiB state"


# -- sharded optimizer state (torch.distributed.checkpoint) and rank 0's choice, on real gloo ranks
# -------------
def _sharded_setup(world, algorithm: str, overlap: bool, width: int = 0):
    from scaleout.optim import ShardedLAMB
    from tests.optim.test_optim_sharded import BUCKET_MB, HP, Net, groups

    net = Net()
    if width:  # a bigger layer, so the optimizer state dwarfs everything else that travels
        net.wide = nn.Linear(width, width)
        net.wide.weight.data.normal_(0, 0.01, generator=torch.Generator().manual_seed(5))
    opt = ShardedLAMB(
        groups(net),
        world,
        overlap=overlap,
        bucket_mb=BUCKET_MB * (1 + width),
        algorithm=algorithm,
        allow_unused=True,
        param_order=net.parameters(),
        **HP,
    )
    return net, opt


def _train_steps(world, net, opt, steps: range) -> None:
    from tests.optim.test_optim_sharded import loss_of

    for s in steps:
        loss = loss_of(net, s, world.rank) + (
            net.wide.weight.square().mean() if hasattr(net, "wide") else 0
        )
        loss.backward()
        opt.step()
        opt.zero_grad()


def _pieces(opt) -> dict:
    _, pieces = opt.sharded_state()
    return {k: (p.offset, p.numel, p.tensor.clone()) for k, p in pieces.items()}


def _save(
    world, directory: str, steps: int, algorithm: str = "flat", overlap: bool = True, keep: int = 2
) -> dict:
    """Train ``steps`` steps, checkpointing after each; return this rank's pieces after every
    step."""
    from scaleout.checkpoint import Checkpointer

    net, opt = _sharded_setup(world, algorithm, overlap)
    ck = Checkpointer(directory, keep=keep, rank=world.rank)
    out = {}
    for s in range(steps):
        _train_steps(world, net, opt, range(s, s + 1))
        rep, shards = opt.sharded_state()
        ck.save(
            s + 1,
            {"model": net.state_dict(), "optimizer": rep},
            world,
            shards,
        )
        out[s + 1] = _pieces(opt)
    return out


def _restore(world, directory: str, algorithm: str = "flat", overlap: bool = False) -> dict:
    from scaleout.checkpoint import Checkpointer
    from scaleout.errors import UserError

    net, opt = _sharded_setup(world, algorithm, overlap)
    try:
        found = Checkpointer(directory, rank=world.rank).restore(
            world, shards=opt.sharded_state()[1]
        )
    except UserError as e:
        return {"error": str(e)}
    state, path = found
    opt.load_replicated(state["optimizer"])
    net.load_state_dict(state["model"])
    return {
        "step": state["step"],
        "path": path.name,
        "pieces": _pieces(opt),
        "group_steps": [g["step"] for g in opt.param_groups],
    }


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Whole per-parameter states from every rank's pieces (each element owned exactly once)."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, int] = {}
    for pieces in per_rank:
        for key, (offset, numel, t) in pieces.items():
            full.setdefault(key, torch.full((numel,), float("nan")))[
                offset : offset + t.numel()
            ] = t
            seen[key] = seen.get(key, 0) + t.numel()
    assert all(seen[k] == full[k].numel() for k in full), "pieces overlap or leave gaps"
    return full


def _unsharded_state(W: int, steps: int) -> dict[str, torch.Tensor]:
    """LAMB on the global batch (the same arithmetic order as the sharded path), keyed like the
    pieces."""
    from scaleout.optim import LAMB
    from tests.optim.test_optim_sharded import HP, Net, _global_batch_grads, groups

    net = Net()
    gs = groups(net)
    opt = LAMB(gs, chunk=None, **HP)
    for s in range(steps):
        _global_batch_grads(net, s, W, 1)
        opt.step()
        opt.zero_grad()
    names = {id(p): n for g in gs for p, n in zip(g["params"], g["names"], strict=True)}
    return {
        f"{k}/{names[id(p)]}": st[k].reshape(-1)
        for p, st in opt.state.items()
        for k in ("exp_avg", "exp_avg_sq")
    }


@pytest.mark.multi_process
@pytest.mark.parametrize("save_shape,load_shape", [((2, 2), (1, 2)), ((1, 2), (2, 2))])
def test_sharded_state_reshards_between_world_sizes(tmp_path, save_shape, load_shape) -> None:
    """Saved by W ranks (overlapped buckets), loaded by another W (one bucket, another
    algorithm): every element lands where it belongs, bit for bit, and equals unsharded LAMB's
    state."""
    from tests.distutil import run_dist

    saved = run_dist(_save, *save_shape, args=(str(tmp_path), 3, "hierarchical", True), timeout=300)
    loaded = run_dist(_restore, *load_shape, args=(str(tmp_path), "flat", False), timeout=300)
    assert all("error" not in r for r in loaded), loaded[0]
    assert {r["step"] for r in loaded} == {3} and {tuple(r["group_steps"]) for r in loaded} == {
        (3, 3)
    }
    before, after = _assemble([r[3] for r in saved]), _assemble([r["pieces"] for r in loaded])
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    ref = _unsharded_state(save_shape[0] * save_shape[1], 3)
    assert ref.keys() == after.keys()
    for (
        k,
        v,
    ) in (
        after.items()
    ):  # the optimizers' sums run in other orders: fp32 rounding, relative to the tensor
        err = float((v - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-12))
        assert err <= 1e-5, (k, err)


@pytest.mark.multi_process
def test_rank0_chooses_and_every_rank_falls_back_together(tmp_path) -> None:
    """Newest checkpoint corrupted (replicated file) or incomplete (a shard file missing): rank 0
    alone decides, and every rank resumes the same older checkpoint with its own shard of that
    step."""
    from tests.distutil import run_dist

    saved = run_dist(_save, 2, 2, args=(str(tmp_path), 3, "flat", True, 3), timeout=300)
    ck = Checkpointer(tmp_path)
    assert [s for s, _ in ck.list()] == [1, 2, 3]
    blob = bytearray(ck.path(3).read_bytes())
    blob[-100] ^= 0xFF
    ck.path(3).write_bytes(bytes(blob))
    (shard_dir,) = tmp_path.glob("ckpt-00000002.shards-*")
    (shard_dir / "__3_0.distcp").unlink()  # rank 3's part of step 2 never made it to disk
    got = run_dist(_restore, 2, 2, args=(str(tmp_path), "flat", True), timeout=300)
    for rank, r in enumerate(got):
        assert "error" not in r, r
        assert (r["step"], r["path"]) == (1, "ckpt-00000001.pt")
        assert r["pieces"].keys() == saved[rank][1].keys()
        assert all(torch.equal(r["pieces"][k][2], saved[rank][1][k][2]) for k in r["pieces"])


@pytest.mark.multi_process
def test_a_rank_that_cannot_read_its_shard_is_named(tmp_path) -> None:
    from tests.distutil import run_dist

    run_dist(_save, 2, 2, args=(str(tmp_path), 2), timeout=300)
    (shard_dir,) = tmp_path.glob("ckpt-00000002.shards-*")
    f = shard_dir / "__2_0.distcp"
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= (
        0x01  # same size: rank 0's completeness check cannot see it; rank 2 reads it
    )
    f.write_bytes(bytes(blob))
    got = run_dist(
        _restore, 2, 2, args=(str(tmp_path), "flat", True), timeout=300
    )  # same layout: rank 2 reads file 2
    errors = {r.get("error") for r in got}
    assert len(errors) == 1, errors  # the same one line on every rank
    (msg,) = errors
    assert (
        msg.startswith("rank 2 cannot read the sharded checkpoint")
        and "__2_0.distcp: sha256 mismatch" in msg
    )
    assert "\n" not in msg


def _object_traffic(world, directory: str, width: int) -> dict:
    """Save + restore through every object collective torch has, recording the pickled bytes of
    each."""
    import torch.distributed.distributed_c10d as c10d

    from scaleout.checkpoint import Checkpointer

    sizes: list[int] = []
    to_tensor, to_object = c10d._object_to_tensor, c10d._tensor_to_object

    def out(obj, *a, **k):
        t, n = to_tensor(obj, *a, **k)
        sizes.append(int(n))
        return t, n

    def back(t, n, *a, **k):
        sizes.append(int(n))
        return to_object(t, n, *a, **k)

    c10d._object_to_tensor, c10d._tensor_to_object = out, back
    try:
        net, opt = _sharded_setup(world, "flat", True, width)
        _train_steps(world, net, opt, range(2))
        ck = Checkpointer(directory, rank=world.rank)
        rep, shards = opt.sharded_state()
        ck.save(
            2,
            {"model": net.state_dict(), "optimizer": rep},
            world,
            shards,
        )
        net2, opt2 = _sharded_setup(world, "flat", True, width)
        state, _ = ck.restore(world, shards=opt2.sharded_state()[1])
    finally:
        c10d._object_to_tensor, c10d._tensor_to_object = to_tensor, to_object
    return {
        "max": max(sizes),
        "total": sum(sizes),
        "shard": opt.state_bytes(),
        "full": 8 * opt.numel,
        "restored": all(
            torch.equal(a.tensor, b.tensor)
            for a, b in zip(
                opt.sharded_state()[1].values(), opt2.sharded_state()[1].values(), strict=True
            )
        ),
    }


@pytest.mark.multi_process
def test_no_rank_receives_more_than_a_fraction_of_its_shard(tmp_path) -> None:
    """At scale the optimizer state must never be gathered: every object that crosses a
    collective during a save and a restore (DCP plans, the chosen path, the structure of the
    replicated state) is small next to a rank's shard (gathering shards, as before, sends one
    object of a whole shard per rank). The other ranks see a tenth of their shard in all; rank 0
    collects DCP's plans (O(world), on the CPU group, but no optimizer state). The shards move
    only between each rank and its files."""
    from tests.distutil import run_dist

    got = run_dist(_object_traffic, 2, 2, args=(str(tmp_path), 512), timeout=300)
    for rank, r in enumerate(got):
        assert r["restored"], rank
        assert r["shard"] * 3.5 < r["full"]  # 4 ranks: each holds about a quarter
        assert r["max"] < r["shard"] / 20, (rank, r)
        assert r["total"] < (r["shard"] if rank == 0 else r["shard"] / 10), (rank, r)
    for f in ("scaleout/checkpoint.py", "scaleout/checkpoint_dcp.py", "scaleout/train/trainer.py"):
        assert "all_gather_object" not in (Path(__file__).resolve().parents[1] / f).read_text(), f


@pytest.mark.unit
def test_save_never_prunes_a_higher_step(tmp_path):
    """An older run left ckpt-1000/1100 in the directory; a save at step 200 used to be deleted
    at once (pruning by step number) and a later resume loaded the other run's weights."""
    old = Checkpointer(tmp_path, keep=2)
    for step in (1000, 1100):
        old.save(step, {"w": torch.full((4,), float(step))})
    new = Checkpointer(tmp_path, keep=2)
    for step in (100, 200, 300):
        new.save(step, {"w": torch.full((4,), float(step))})
    assert [s for s, _ in new.list()] == [
        200,
        300,
        1000,
        1100,
    ]  # keep=2 of this run's steps, the rest untouched


def _save_many(directory, tag: float, n: int, errors: list) -> None:
    ck = Checkpointer(directory, keep=1)
    try:
        for _ in range(n):
            ck.save(5, {"w": torch.full((1 << 18,), tag)})  # 1 MiB payload: writes overlap
    except Exception as exc:  # noqa: BLE001 -- collected for the assertion
        errors.append(repr(exc))


@pytest.mark.unit
def test_two_writers_of_one_checkpoint_name_never_share_a_tmp_file(tmp_path):
    """Two runs saving the same step used to share '<name>.tmp': one's rename failed (the other
    had moved the file) or the file mixed both payloads. Each writer now has its own temporary
    name."""
    import threading

    errors: list = []
    threads = [
        threading.Thread(target=_save_many, args=(tmp_path, float(t), 20, errors)) for t in (1, 2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    state = decode(
        Checkpointer(tmp_path).path(5).read_bytes()
    )  # whole and consistent: one writer's payload
    assert torch.unique(state["w"]).numel() == 1
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.full_system
def test_atomic_write_that_fails_keeps_the_old_file_and_no_debris(tmp_path):
    """A write that fails half-way (here the file-size limit, as a full disk would) leaves the
    previous file as it was and no temporary file (report.json and run.json are written this
    way)."""
    import subprocess
    import sys

    target = tmp_path / "report.json"
    target.write_text('{"old": true}')
    code = (
        "import resource, signal, sys; from pathlib import Path; signal.signal(signal.SIGXFSZ, "
        "signal.SIG_IGN);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096));"
        "from scaleout.fsutil import atomic_write;"
        "atomic_write(Path(sys.argv[1]), b'x' * 100000)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr[-2000:]
    assert target.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


@pytest.mark.unit
def test_resume_refuses_a_checkpoint_written_with_another_global_batch():
    from scaleout.train.rerun import check_data_position

    check_data_position({"step": 10, "data_position": 640}, 64, "ckpt-10")
    check_data_position(
        {"step": 10}, 64, "ckpt-10"
    )  # older checkpoints without a position: nothing to compare
    with pytest.raises(
        UserError, match=r"data position 640 \(global batch 64\), but train.global_batch=32"
    ):
        check_data_position({"step": 10, "data_position": 640}, 32, "ckpt-10")


_OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
)


def _checkpoint_traffic(world, out: str, overrides: list[str]) -> dict:
    """The trainer (dropout on) under an emulated CUDA device whose default group is NCCL-like:
    2 steps saving after each, then a rerun to step 3 that resumes. Every object collective issued
    inside ``save_checkpoint`` / ``resume`` is recorded with whether it ran on a CPU group, and
    the pickled bytes each rank receives there are summed."""
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from scaleout.config import load_config
    from scaleout.train.trainer import Trainer
    from tests.fakecuda import FakeCuda

    phase: list[str] = []
    calls: dict[str, list] = {"save": [], "resume": []}
    received = {"save": 0, "resume": 0}

    def recorded(name: str, fc: FakeCuda):
        orig = getattr(dist, name)
        sig = inspect.signature(orig)

        def call(*args, **kwargs):
            if phase:
                group = sig.bind(*args, **kwargs).arguments.get("group")
                calls[phase[-1]].append((name, fc.is_cpu_group(group)))
            return orig(*args, **kwargs)

        return call

    to_object = c10d._tensor_to_object

    def unpickled(tensor, size, *args, **kwargs):
        if phase:
            received[phase[-1]] += int(size)
        return to_object(tensor, size, *args, **kwargs)

    def during(name: str, method):
        def run(self, *args, **kwargs):
            phase.append(name)
            try:
                return method(self, *args, **kwargs)
            finally:
                phase.pop()

        return run

    def cfg(steps: int):
        return load_config(
            "bert_tiny_cpu",
            [
                "train.global_batch=8",
                "data.eval_samples=16",
                "optim.warmup_steps=1",
                "optim.total_steps=8",
                "train.progress=false",
                "train.eval_every=2",
                "comm.bucket_mb=0.25",
                "model.bert.dropout=0.1",
                f"train.max_steps={steps}",
                f"train.output_dir={out}/out",
                f"checkpoint.dir={out}/ckpt",
                "checkpoint.every_steps=1",
                *overrides,
            ],
        )

    with FakeCuda(world) as fc:
        for name in _OBJECT_COLLECTIVES:
            fc._patch(dist, name, recorded(name, fc))
        fc._patch(c10d, "_tensor_to_object", unpickled)
        fc._patch(Trainer, "save_checkpoint", during("save", Trainer.save_checkpoint))
        fc._patch(Trainer, "resume", during("resume", Trainer.resume))
        statuses = []
        for steps in (2, 3):
            trainer = Trainer(cfg(steps), world)
            trainer._report = lambda *a, **k: None  # noqa: ARG005 -- reads the GPU's name only
            statuses.append((trainer.start_step, trainer.train().status))
    return {"calls": calls, "received": received, "statuses": statuses, "violations": fc.violations}


@pytest.mark.full_system
@pytest.mark.parametrize(
    "overrides",
    [pytest.param([], id="dataparallel"), pytest.param(["optim.sharded=true"], id="sharded")],
)
def test_checkpoints_move_no_object_through_the_device_group(tmp_path, overrides) -> None:
    """2 x 2 ranks whose default group is an emulated NCCL one (tests/fakecuda.py: no GPU
    exists here). Saving and resuming issue no object collective on it (each would pickle through
    the GPU, and a gather or scatter at rank 0 is a ncclSend/ncclRecv pair per rank: at 2,048 ranks
    rank 0 sets up ~2k P2P connections). A data-parallel save moves no object at all (every rank's
    RNG state used to be gathered to rank 0 and scattered back on a resume); a resume moves the
    chosen file and the state's structure through the store, not a collective; the sharded
    optimizer's DCP plans and digests travel on the CPU (gloo) group."""
    from tests.distutil import run_dist

    got = run_dist(_checkpoint_traffic, 2, 2, args=(str(tmp_path), overrides), timeout=600)
    for rank, r in enumerate(got):
        assert r["violations"] == [] and r["statuses"] == [(0, "max_steps"), (2, "max_steps")], r
        everything = r["calls"]["save"] + r["calls"]["resume"]
        # a data-parallel resume moves its objects through the store (scaleout/store_share.py):
        # no object collective at all; DCP's plans need a group
        assert everything or not overrides, "nothing recorded: the check is blind"
        on_device = [name for name, cpu in everything if not cpu]
        assert on_device == [], f"rank {rank}: object collectives on the NCCL group: {on_device}"
        # two resumes (the first finds nothing); DCP's load adds its plan exchange (3 collectives)
        limit = 2 * 2 + (4 if overrides else 0)
        assert len(r["calls"]["resume"]) <= limit, (rank, r["calls"]["resume"])
        if not overrides:
            assert r["calls"]["save"] == [] and r["received"]["save"] == 0, (rank, r)
            assert r["calls"]["resume"] == [] and r["statuses"][1][0] == 2, (rank, r)


def _agree(world, dirs, overrides):
    from scaleout.config import load_config
    from scaleout.train import rerun

    cfg = load_config("bert_tiny_cpu", [f"checkpoint.dir={dirs[world.rank]}", *overrides])
    try:
        local = rerun.decide_start(cfg).kind
    except UserError:
        local = "refused"
    try:
        agreed = rerun.agree_start(cfg, world).kind
    except UserError as exc:
        agreed = f"refused: {exc}"
    return local, agreed


@pytest.mark.multi_process
def test_start_decision_is_rank0s_on_every_rank(tmp_path):
    """The rerun policy is decided on rank 0 and broadcast: a rank whose view of checkpoint.dir
    differs (NFS attribute caching after a requeue; emulated by giving rank 1 another folder)
    neither exits "finished" nor refuses while rank 0 goes on (it would leave rank 0 waiting in
    rendezvous until train.init_timeout_s), and a refusal on rank 0 is raised on every rank."""
    from distutil import run_dist

    fresh, done = tmp_path / "fresh", tmp_path / "done"
    fresh.mkdir()
    done.mkdir()
    (done / "ckpt-00000010.pt").write_bytes(b"x")
    res = run_dist(_agree, 1, 2, args=([str(fresh), str(done)], ["train.max_steps=10"]))
    assert [r[0] for r in res] == ["new", "finished"]  # what each rank alone would do
    assert [r[1] for r in res] == ["new", "new"]
    res = run_dist(
        _agree,
        1,
        2,
        args=([str(done), str(fresh)], ["train.max_steps=20", "checkpoint.resume=false"]),
    )
    assert [r[0] for r in res] == ["refused", "new"]
    assert all(r[1].startswith("refused: checkpoint.dir=") for r in res), res
