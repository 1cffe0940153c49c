"""MLPerf llama31_8b with the REAL compliance checker (mlperf-logging's newest ruleset, 6.1.0).

The closed rules pin the reference's own values (max_sequence_length 8192, eval_samples 1024,
max_steps 1,200,000, the cosine's decay steps, log-perplexity <= 3.3), which a CPU-sized run cannot
have. So: the 8B config's logged hyper-parameters pass the unmodified closed checker on a synthetic
log (written by the trainer's logger), and the CPU run (tests/families/llama/test_llama_bar.py)
is checked against the open division. Also the MLPerf C4 layout reader (data.source=c4)."""

from __future__ import annotations

import numpy as np
import pytest

from scaleout.config import load_config
from scaleout.errors import UserError
from scaleout.families.llama.data.c4 import VALIDATION, c4_corpus
from scaleout.families.llama.data.indexed import write_indexed
from scaleout.families.llama.data.rows import Rows
from scaleout.telemetry.mlperf import RULESET, MLPerfLogger, check_compliance
from scaleout.train.hparams import hyperparameters

CONFIG = "configs/llama31_8b_16x8.yaml"


def _log(path, overrides: list[str], perplexities: list[float]) -> None:
    """The trainer's sequence of calls for a run at the 8B config, evaluating every 12,288
    sequences."""
    cfg = load_config(CONFIG, overrides)
    ml = MLPerfLogger(path)
    ml.cache_clear()
    ml.init_start()
    ml.submission("llama31_8b", org="scaleout", division="closed", status="onprem", platform="x")
    ml.hyperparameters(hyperparameters(cfg, world_size=128, config_file=CONFIG))
    ml.init_stop()
    ml.run_start()
    every = cfg.train.eval_every * cfg.train.global_batch
    samples = 0
    for ppl in perplexities:
        ml.block_start(first_epoch_num=samples, epoch_count=every, samples=samples)
        samples += every
        ml.eval_start(epoch_num=samples, samples=samples)
        ml.eval_accuracy(ppl, epoch_num=samples, samples=samples)
        ml.eval_stop(epoch_num=samples, samples=samples)
        ml.block_stop(first_epoch_num=samples - every, samples=samples)
    ml.train_samples(samples)
    ml.eval_samples(cfg.data.eval_samples)
    ml.run_stop("success" if perplexities[-1] <= 3.3 else "aborted", samples=samples)
    ml.close()


def _failures(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "WARNING" in ln and "CHECK" in ln]


@pytest.mark.unit
def test_the_8b_config_passes_the_closed_checker_unmodified(tmp_path) -> None:
    assert RULESET["llama31_8b"] == "6.1.0"
    log = tmp_path / "closed.log"
    _log(log, [], [4.1, 3.6, 3.29])
    ok, out = check_compliance(log, "llama31_8b")
    assert ok, out
    # and the rules bite: never reaching 3.3, and a clip norm other than the reference's, each fail
    _log(log, [], [4.1, 3.6, 3.31])
    ok, out = check_compliance(log, "llama31_8b")
    assert not ok
    _log(log, ["optim.clip_grad_norm=0.5"], [4.1, 3.29])
    ok, out = check_compliance(log, "llama31_8b")
    assert not ok and any("opt_gradient_clip_norm" in f for f in _failures(out)), out
    _log(log, ["optim.schedule=poly"], [4.1, 3.29])
    ok, out = check_compliance(log, "llama31_8b")
    assert not ok and any("opt_learning_rate_decay_schedule" in f for f in _failures(out)), out


@pytest.mark.unit
def test_the_c4_layout_is_read_as_the_reference_lays_it_out(tmp_path) -> None:
    rng = np.random.default_rng(0)
    docs = {k: [rng.integers(0, 100, n) for n in (5, 9, 3)] for k in (0, 1, 10)}
    for k, ds in docs.items():
        write_indexed(tmp_path / f"c4-train.en_{k}_text_document", ds, np.uint16)
    val = [np.arange(7), np.arange(4)]
    with pytest.raises(UserError, match="c4-validation-91205-samples.en_text_document.idx"):
        c4_corpus(tmp_path)
    write_indexed(tmp_path / VALIDATION, val, np.uint16)
    train, held = c4_corpus(tmp_path)
    # the shards in their numeric order (0, 1, 10), as the reference numbers them
    want = [d for k in (0, 1, 10) for d in docs[k]]
    assert len(train) == 9 and train.total_tokens == sum(map(len, want))
    for i, d in enumerate(want):
        assert np.array_equal(train[i], d)
    rows = Rows(train, 4)
    assert len(rows) == train.total_tokens // 4
    tokens, doc_ids = rows[1]  # tokens 4..7 of the stream: doc 0's last, doc 1's first three
    assert np.array_equal(tokens, np.concatenate([want[0][4:], want[1][:3]]))
    assert doc_ids.tolist() == [0, 1, 1, 1]
    assert [held[i].tolist() for i in range(2)] == [list(range(7)), list(range(4))]
    with pytest.raises(UserError, match="data.source=c4 needs data.path"):
        c4_corpus(None)
    with pytest.raises(UserError, match="no c4-train"):
        c4_corpus(tmp_path / "nothing")
    cfg = load_config(CONFIG, [f"data.path={tmp_path}"])
    assert cfg.data.source == "c4" and cfg.model.llama.seq_len == 8192


@pytest.mark.unit
def test_seed_logs_go_through_the_rcp_checker(tmp_path) -> None:
    """`scaleout mlperf rcp` over llama31_8b seed logs at batch 128: converging as the RCP does
    passes, converging much faster than every reference run fails (the real rcp_checker, ruleset
    6.1.0: a submission may be slower than the reference, never implausibly faster)."""
    from scaleout.telemetry.mlperf import check_rcp

    def seeds(folder: str, evals: int) -> None:
        (tmp_path / folder).mkdir()
        for k in range(10):  # llama31_8b asks for 10 runs
            curve = [4.0] * (evals + k % 2 - 1) + [3.29]
            _log(tmp_path / folder / f"result_{k}.txt", [f"train.seed={k}"], curve)

    seeds("rcp", 28)  # ~28 x 12,288 = 344 k sequences: the RCP mean at 128 is 345.9 k
    r = check_rcp([tmp_path / "rcp"])
    assert r.benchmark == "llama31_8b" and r.ruleset == "6.1.0" and r.global_batch == 128
    assert r.passed, r.render()
    seeds("fast", 10)  # ~123 k sequences: the RCPs' fastest run at 128 needed 307 k
    r = check_rcp([tmp_path / "fast"])
    assert not r.passed, r.render()
