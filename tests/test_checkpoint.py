"""Checkpoints: round trip, corruption/truncation fall-back, keep-N, and bitwise-exact resume."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from scaleout.checkpoint import Checkpointer, CorruptCheckpoint, decode, encode, rng_state, set_rng_state
from scaleout.data.sampler import ShardedSampler
from scaleout.errors import UserError


def test_round_trip_keep_n_and_weights_only(tmp_path):
    ck = Checkpointer(tmp_path, keep=2)
    model = nn.Linear(3, 2)
    for step in (10, 20, 30):
        ck.save(step, {"model": model.state_dict(), "data_position": step * 8, "rng": [rng_state()]})
    assert [s for s, _ in ck.list()] == [20, 30]
    state, path = ck.load_latest()
    assert path.name == "ckpt-00000030.pt" and state["step"] == 30 and state["data_position"] == 240
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert not list(tmp_path.glob("*.tmp"))
    # non-zero ranks write nothing
    assert Checkpointer(tmp_path / "r1", rank=1).save(1, {"x": 1}) is None and not (tmp_path / "r1").exists()
    # weights_only=True really is used: an arbitrary object is refused
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        decode(encode({"bad": Checkpointer}))
    with pytest.raises(UserError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)


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


def _train(steps: int, ckpt_dir, stop_at: int | None = None, resume: bool = False, restore_rng: bool = True) -> dict:
    """A real loop: model + AdamW + LR schedule + sampler + python/numpy/torch randomness."""
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
        # perturb every RNG, so only the restored state can reproduce the run
        torch.manual_seed(123)
        np.random.seed(123)
        random.seed(123)
        state, _ = ck.load_latest()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        if restore_rng:
            set_rng_state(state["rng"][0])
        step, position = state["step"], state["data_position"]
    while step < steps:
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
            ck.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                           "schedule": sched.state_dict(), "data_position": position, "rng": [rng_state()]})
            return {}
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_bitwise_resume(tmp_path):
    torch.use_deterministic_algorithms(True)
    try:
        full = _train(30, tmp_path / "a")
        _train(30, tmp_path / "b", stop_at=13)  # "interrupted" after 13 steps (crosses an epoch: 13*16 > 200)
        resumed = _train(30, tmp_path / "b", resume=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    # and the check is sharp: a resume that does not restore the RNG states diverges
    torch.use_deterministic_algorithms(True)
    try:
        wrong = _train(30, tmp_path / "b", resume=True, restore_rng=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not all(torch.equal(full[k], wrong[k]) for k in full)


def test_save_never_prunes_a_higher_step(tmp_path):
    """An older run left ckpt-1000/1100 in the directory; a save at step 200 used to be deleted at once
    (pruning by step number) and a later resume loaded the other run's weights."""
    old = Checkpointer(tmp_path, keep=2)
    for step in (1000, 1100):
        old.save(step, {"w": torch.full((4,), float(step))})
    new = Checkpointer(tmp_path, keep=2)
    for step in (100, 200, 300):
        new.save(step, {"w": torch.full((4,), float(step))})
    assert [s for s, _ in new.list()] == [200, 300, 1000, 1100]  # keep=2 of this run's steps, the rest untouched


def _save_many(directory, tag: float, n: int, errors: list) -> None:
    ck = Checkpointer(directory, keep=1)
    try:
        for _ in range(n):
            ck.save(5, {"w": torch.full((1 << 18,), tag)})  # 1 MiB payload: writes overlap
    except Exception as exc:  # noqa: BLE001 -- collected for the assertion
        errors.append(repr(exc))


def test_two_writers_of_one_checkpoint_name_never_share_a_tmp_file(tmp_path):
    """Two runs saving the same step used to share '<name>.tmp': one's rename failed (the other had moved
    the file) or the file mixed both payloads. Each writer now has its own temporary name."""
    import threading

    errors: list = []
    threads = [threading.Thread(target=_save_many, args=(tmp_path, float(t), 20, errors)) for t in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    state = decode(Checkpointer(tmp_path).path(5).read_bytes())  # whole and consistent: one writer's payload
    assert torch.unique(state["w"]).numel() == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_atomic_write_that_fails_keeps_the_old_file_and_no_debris(tmp_path):
    """A write that fails half-way (here the file-size limit, as a full disk would) leaves the previous
    file as it was and no temporary file (report.json and run.json are written this way)."""
    import subprocess
    import sys

    target = tmp_path / "report.json"
    target.write_text('{"old": true}')
    code = (
        "import resource, signal, sys; from pathlib import Path; signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096));"
        "from scaleout.checkpoint import atomic_write;"
        "atomic_write(Path(sys.argv[1]), b'x' * 100000)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "File too large" in r.stderr, r.stderr[-2000:]
    assert target.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_resume_refuses_a_checkpoint_written_with_another_global_batch():
    from scaleout.train.rerun import check_data_position

    check_data_position({"step": 10, "data_position": 640}, 64, "ckpt-10")
    check_data_position({"step": 10}, 64, "ckpt-10")  # older checkpoints without a position: nothing to compare
    with pytest.raises(UserError, match=r"data position 640 \(global batch 64\), but train.global_batch=32"):
        check_data_position({"step": 10, "data_position": 640}, 32, "ckpt-10")
