"""scaleout ckpt: inspect a training checkpoint, export its weights as a plain state dict and for
Hugging Face, convert the MLCommons phase-1 TensorFlow checkpoint."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

NAME = "ckpt"
ORDER = 45
HELP = (
    "checkpoints: 'show' (step, config, sha256, shards), 'export' (plain .pt + Hugging Face "
    "BertForPreTraining), 'convert' (MLCommons TF phase-1 checkpoint -> .pt)"
)
DESCRIPTION = """\
scaleout ckpt show    RUN_DIR_OR_CKPT
scaleout ckpt export  RUN_DIR_OR_CKPT [--out DIR] [--format plain,hf] [--config CONFIG [key=value]]
scaleout ckpt convert TF_CHECKPOINT --out FILE.pt [--config CONFIG [key=value ...]]

RUN_DIR_OR_CKPT: a ckpt-<step>.pt file, a checkpoint directory (its newest checkpoint that verifies
is used), or a run directory holding one (ckpt/ or checkpoint/ inside it).

show: step, data position, samples, the run's config (model, data, optim), the file's sha256
(compare with sha256sum), the weights and any optimizer shards (per-rank states in the file, and
files beside it).

export (BERT): DIR/model_state_dict.pt is the model's state dict in scaleout names (torch.load
works, and model.init_checkpoint loads it); DIR/hf/ holds pytorch_model.bin in Hugging Face
BertForPreTraining names plus config.json, so BertForPreTraining.from_pretrained(DIR/hf) loads it.
The name mapping is scaleout/families/bert/convert.py (the same one model.init_checkpoint reads).
Checkpoints written before the config was stored need --config (the run's config file or name and
overrides).

convert: the MLCommons BERT phase-1 TensorFlow checkpoint (the prefix model.ckpt-28252, its .index
file or its directory) -> FILE.pt, a state dict in Hugging Face names that model.init_checkpoint
reads; optimizer slots and global_step are dropped. Needs tensorflow (pip install 'scaleout[tf]').
With --config, FILE.pt is checked against that config's model (names and shapes) before it is used.
Mapping: scaleout/families/bert/tf_checkpoint.py; the whole path: docs/mlperf-data.md.

examples:
  scaleout ckpt show runs/bert_tiny_cpu/ckpt
  scaleout ckpt export runs/bert_tiny_cpu/ckpt --out exported/
  scaleout ckpt export old/ckpt-00001500.pt --config bert_tiny_cpu model.bert.layers=2
  scaleout ckpt convert /data/phase1/model.ckpt-28252 --out /data/phase1/model.ckpt-28252.pt \
    --config bert_large_256x8
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("show", "export", "convert"), help="show, export or convert")
    p.add_argument(
        "path",
        help="checkpoint file, checkpoint directory or run directory; convert: TF checkpoint",
    )
    p.add_argument(
        "--out",
        default=None,
        help="export: output directory (default: <checkpoint>-export/); convert: the .pt to write",
    )
    p.add_argument(
        "--format", default="plain,hf", help="export: comma list of plain, hf (default both)"
    )
    p.add_argument(
        "--config",
        nargs="+",
        default=None,
        metavar="CONFIG [key=value]",
        help="the run's config (only for checkpoints that do not store it); convert: check it",
    )


def find_checkpoint(path: str) -> tuple[dict[str, Any], Path]:
    """(state, file) for a file, a checkpoint directory (newest that verifies) or a run
    directory."""
    from scaleout.checkpoint import Checkpointer, read_checkpoint
    from scaleout.errors import UserError

    p = Path(path)
    if p.is_file():
        return read_checkpoint(p), p
    if not p.is_dir():
        raise UserError(
            f"{path} does not exist; expected a ckpt-<step>.pt file, a checkpoint or a run "
            "directory"
        )
    for d in (p, p / "ckpt", p / "checkpoint", p / "checkpoints"):
        found = Checkpointer(d).load_latest() if d.is_dir() else None
        if found is not None:
            return found
    raise UserError(
        f"{path}: no checkpoint (ckpt-<step>.pt) that verifies in it or in its ckpt/ folder"
    )


def _config(state: dict[str, Any], override: list[str] | None) -> Any:
    from scaleout.config import load_config
    from scaleout.config.schema import Config
    from scaleout.errors import UserError

    if override:
        return load_config(override[0], override[1:])
    if isinstance(state.get("config"), dict):
        return Config.model_validate(state["config"])
    raise UserError(
        "this checkpoint does not store its config; pass --config CONFIG [key=value ...]"
    )


def show(state: dict[str, Any], path: Path, override: list[str] | None) -> None:
    model = state.get("model", {})
    params = sum(t.numel() for t in model.values())
    opt = state.get("optimizer")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    beside = sorted(q for q in path.parent.iterdir() if q.name.startswith(path.stem) and q != path)
    print(f"checkpoint  {path} ({path.stat().st_size / 2**20:.1f} MiB, verified)")
    print(f"sha256      {digest}")
    print(
        f"step        {state.get('step')}  data position {state.get('data_position')}  "
        f"samples {state.get('samples')}  skipped steps {state.get('skipped')}"
    )
    print(f"weights     {len(model)} tensors, {params:,} parameters")
    shards = (
        f"{len(opt)} per-rank optimizer states in the file"
        if isinstance(opt, list)
        else "one optimizer state"
    )
    print(f"shards      {shards}" + "".join(f"; {_describe(q)}" for q in beside))
    try:
        cfg = _config(state, override)
    except Exception as exc:  # show what there is even without a config
        print(f"config      unknown ({exc})")
        return
    for section in ("model", "data", "optim", "train"):
        print(f"config.{section:<6} {getattr(cfg, section).model_dump(mode='json')}")


def _describe(q: Path) -> str:
    if q.is_dir():
        files = [f for f in q.rglob("*") if f.is_file()]
        return (
            f"{q.name}/: {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB"
        )
    return f"{q.name}: {q.stat().st_size / 2**20:.1f} MiB"


def hf_config(b: Any) -> dict[str, Any]:
    """Hugging Face BertConfig fields of a model.bert config (activation names: bert_convert
    docstring)."""
    return {
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
        "vocab_size": b.vocab_size,
        "hidden_size": b.hidden,
        "num_hidden_layers": b.layers,
        "num_attention_heads": b.heads,
        "intermediate_size": b.intermediate,
        "hidden_act": "gelu_new" if b.activation == "gelu_tanh" else "gelu",
        "hidden_dropout_prob": b.dropout,
        "attention_probs_dropout_prob": b.dropout,
        "max_position_embeddings": b.max_position,
        "type_vocab_size": b.type_vocab_size,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
    }


def export(
    state: dict[str, Any], path: Path, out: Path, formats: list[str], override: list[str] | None
) -> None:
    import torch

    from scaleout.errors import UserError
    from scaleout.families.bert.convert import to_hf

    model = state["model"]
    cfg = _config(state, override) if "hf" in formats else None
    if cfg is not None and not cfg.model.family.hf_checkpoints:
        raise UserError(
            f"--format hf: model.arch={cfg.model.arch!r}; only BERT has a Hugging Face layout"
        )
    out.mkdir(parents=True, exist_ok=True)
    if "plain" in formats:
        torch.save(model, out / "model_state_dict.pt")
        print(f"plain state dict ({len(model)} tensors) -> {out / 'model_state_dict.pt'}")
    if cfg is not None:
        hf = out / "hf"
        hf.mkdir(exist_ok=True)
        torch.save(to_hf(model, cfg.model.bert.layers), hf / "pytorch_model.bin")
        (hf / "config.json").write_text(json.dumps(hf_config(cfg.model.bert), indent=2) + "\n")
        print(f"Hugging Face BertForPreTraining -> {hf}/ (pytorch_model.bin, config.json)")


def run(args: argparse.Namespace) -> int:
    from scaleout.errors import UserError

    formats = [f.strip() for f in args.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("plain", "hf")]
    if bad or not formats:
        raise UserError(f"--format {args.format!r}: expected a comma list of plain, hf")
    if args.action == "convert":
        return convert(args.path, args.out, args.config)
    state, path = find_checkpoint(args.path)
    if args.action == "show":
        show(state, path, args.config)
    else:
        export(
            state,
            path,
            Path(args.out) if args.out else path.with_name(path.stem + "-export"),
            formats,
            args.config,
        )
    return 0


def convert(src: str, out: str | None, config: list[str] | None) -> int:
    """TF phase-1 checkpoint -> out (.pt); with config, check it loads into that model."""
    from scaleout.errors import UserError

    if not out:
        raise UserError("convert needs --out FILE.pt (where to write the converted weights)")
    cfg = None
    if config:  # a bad config fails here, before the (slow) TF import and read
        from scaleout.config import load_config

        cfg = load_config(config[0], config[1:])
        if cfg.model.arch != "bert":
            raise UserError(
                f"convert --config: model.arch={cfg.model.arch!r}; the TF checkpoint is BERT's"
            )
    from scaleout.families.bert.tf_checkpoint import convert as tf_convert

    sd = tf_convert(src, out, cfg.model.bert if cfg is not None else None)
    params = sum(t.numel() for t in sd.values())
    checked = f", checked against {config[0]}'s model.bert" if config else ""
    print(f"TF checkpoint {src}: {len(sd)} tensors, {params:,} parameters{checked} -> {out}")
    print(f"use it: model.init_checkpoint={out}")
    return 0
