"""The model-family registry and its one-fact-in-one-place formulas.

Each fact had two owners before the families (issue 25): BERT FLOPs (the trainer's per-batch count
and the simulator's per-sequence formula, which left out the NSP head), BERT parameters (the
simulator's formula and the sweep's meta-device count), ResNet FLOPs (the model's hook count with
bn_group=1, the report's scaled 4.1 G constant otherwise), and the no-decay rule (chosen by
optimizer name). These tests pin one owner.
"""

from __future__ import annotations

import pytest
import torch

from scaleout.config import load_config
from scaleout.config.schema import Config, DataConfig, ModelConfig
from scaleout.errors import ConfigError
from scaleout.families import FAMILIES, data_sources
from scaleout.families.bert import NVIDIA_BERT_NO_DECAY
from scaleout.families.bert.config import BertConfig
from scaleout.families.bert.data.bert_batch import BertSequence, build_batch
from scaleout.families.bert.flops import batch_flops, bert_params
from scaleout.families.bert.model import BertForPreTraining
from scaleout.families.resnet import LARS_EXCLUDE
from scaleout.families.resnet.config import ResNetConfig
from scaleout.families.resnet.flops import forward_macs, resnet_params, training_flops_per_image
from scaleout.families.resnet.model import ResNet, count_macs
from scaleout.optim.groups import param_groups
from scaleout.sim.fromconfig import from_config
from scaleout.sim.step import get_model

pytestmark = pytest.mark.unit

BERTS = [
    {
        "hidden": 64,
        "layers": 2,
        "heads": 2,
        "intermediate": 256,
        "vocab_size": 512,
        "max_position": 64,
    },
    {"hidden": 128, "layers": 3, "heads": 4, "intermediate": 320, "vocab_size": 1000},
    {"hidden": 96, "layers": 1, "heads": 3, "intermediate": 96, "type_vocab_size": 3},
]
RESNETS = [
    {"depth": 18, "width": 8, "num_classes": 10, "image_size": 32},
    {"depth": 50, "width": 4, "num_classes": 10, "image_size": 16},
    {"depth": 34, "width": 4, "num_classes": 7, "image_size": 130},
    {"depth": 101, "width": 4, "num_classes": 10, "image_size": 24},
]


def test_schema_reads_the_registry() -> None:
    assert FAMILIES.names()[:2] == ("bert", "resnet")
    for name in FAMILIES.names():  # every registered arch validates, nothing else does
        assert ModelConfig(arch=name).arch == name
    for source in data_sources():
        assert DataConfig(source=source).source == source
    with pytest.raises(ValueError, match="data.source='nope': expected 'synthetic', 'pydoc'"):
        DataConfig(source="nope")
    assert set(data_sources()) >= {"synthetic", "pydoc", "wikipedia", "imagenet"}
    for name, fam in FAMILIES.items():  # the section key is the arch, its type the family's
        assert isinstance(getattr(Config().model, name), fam.config)
    expected = "model.arch=.nope.: expected .bert., .resnet. or .llama."
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["model.arch=nope"])


def test_bn_group_check_is_the_resnet_family_s() -> None:
    cfg = load_config("resnet_cpu", ["model.resnet.bn_group=2", "train.global_batch=6"])
    cfg.check_world(2)
    with pytest.raises(ConfigError, match="model.resnet.bn_group=2 must divide the world size 3"):
        cfg.check_world(3)
    # a BERT config ignores model.resnet entirely
    load_config(None, ["model.resnet.bn_group=2", "train.global_batch=6"]).check_world(3)


@pytest.mark.parametrize("kw", BERTS)
def test_bert_parameters_formula_equals_the_model(kw: dict) -> None:
    cfg = BertConfig(**kw)
    with torch.device("meta"):
        model = BertForPreTraining(cfg)
    assert bert_params(cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kw", BERTS)
@pytest.mark.parametrize("unpad", [True, False])
def test_simulator_bert_flops_equal_the_trainer_s_count(kw: dict, unpad: bool) -> None:
    """The simulator's sample (one sequence padded to max_seq_len, mask_prob of it masked) costs
    what the trainer counts on such a batch: the simulator once left out the NSP head."""
    b = BertConfig(**kw, unpad_mlm_head=unpad)
    cfg = load_config(
        None,
        [f"model.bert.{k}={v}" for k, v in b.model_dump().items() if v is not None]
        + ["data.max_seq_len=64", "data.mask_prob=0.125", "train.global_batch=8"],
    )
    masked = list(range(1, 64, 8))  # 8 = 0.125 x 64 positions
    seq = BertSequence([5] * 64, [0] * 64, masked, [7] * len(masked), 1)
    batch = build_batch([seq], [[0]], 64, max_predictions=len(masked))
    assert from_config(cfg).model.flops_per_sample == pytest.approx(
        batch_flops(cfg.model.bert, batch), rel=1e-12
    )


@pytest.mark.parametrize("kw", RESNETS)
def test_resnet_formula_equals_the_model_whatever_the_bn_group(kw: dict) -> None:
    model = ResNet(kw["depth"], kw["width"], kw["num_classes"], kw["image_size"])
    macs = count_macs(model, (1, 3, kw["image_size"], kw["image_size"]))
    params = sum(p.numel() for p in model.parameters())
    for k in (
        1,
        2,
        8,
    ):  # the trainer once used the model's count at bn_group=1, a scaled constant else
        cfg = ResNetConfig(**kw, bn_group=k)
        assert forward_macs(cfg) == macs
        assert training_flops_per_image(cfg) == 6.0 * macs
        assert resnet_params(cfg) == params


def test_resnet50_preset_and_simulator_use_the_formula() -> None:
    assert get_model("resnet50").flops_per_sample == training_flops_per_image(ResNetConfig())
    assert forward_macs(ResNetConfig()) == pytest.approx(4.09e9, rel=1e-3)
    run = from_config(load_config("resnet_cpu"))
    r = load_config("resnet_cpu").model.resnet
    assert run.model.flops_per_sample == training_flops_per_image(r)
    assert run.model.params == resnet_params(r)
    bg = from_config(load_config("resnet_cpu", ["model.resnet.bn_group=2"]))
    assert bg.model.flops_per_sample == run.model.flops_per_sample


def _names(groups: list[dict]) -> list[list[str]]:
    return [g["names"] for g in groups]


def test_family_no_decay_keeps_the_optimizer_chosen_groups() -> None:
    """The no-decay rule moved from the optimizer name (lamb/adamw: NVIDIA BERT's, lars/sgd:
    LARS's) to the family; on the built-in models every rule gives the same groups, so the
    configs train as before."""
    bert = BertForPreTraining(BertConfig(**BERTS[0]))
    resnet = ResNet(18, 8, 10, 32)
    assert FAMILIES.get("bert").no_decay == NVIDIA_BERT_NO_DECAY
    assert FAMILIES.get("resnet").no_decay == LARS_EXCLUDE
    for model, arch in ((bert, "bert"), (resnet, "resnet")):
        family = _names(param_groups(model, 0.01, FAMILIES.get(arch).no_decay))
        assert family == _names(param_groups(model, 0.01, NVIDIA_BERT_NO_DECAY))
        assert family == _names(param_groups(model, 0.01, LARS_EXCLUDE))


def test_mlperf_facts_come_from_the_family() -> None:
    from scaleout.telemetry.report import RunReport
    from scaleout.train.hparams import hyperparameters

    for name, fam in FAMILIES.items():
        report = RunReport(
            arch=name, time_to_train_s=1.0, steps=1, samples=1, flops_per_sample=1.0, devices=1
        )
        assert report.quality_exponent == fam.quality_exponent
    assert FAMILIES.get("bert").benchmark == "bert" and FAMILIES.get("resnet").benchmark == "resnet"
    assert "opt_lamb_epsilon" in hyperparameters(load_config("bert_tiny_cpu"), 1)
    assert "lars_opt_momentum" in hyperparameters(load_config("resnet_cpu"), 1)
    assert FAMILIES.get("bert").epoch_of(1000, 10) == 1000  # MLPerf BERT counts samples
    assert FAMILIES.get("resnet").epoch_of(1000, 300) == 3


def test_docs_table_lists_the_registered_families() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "extending.md").read_text()
    text = text[text.index("## A model family") : text.index("## An all-reduce algorithm")]
    rows = [line for line in text.splitlines() if line.startswith("| `")][1:]  # below the header
    assert [r.split("`")[1] for r in rows] == list(FAMILIES.names())
    for row, (name, fam) in zip(rows, FAMILIES.items(), strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].split(", ") == list(fam.data_sources), name
        assert cells[3] == fam.metric and cells[4] == (fam.benchmark or "-"), name


def test_data_source_must_be_one_the_family_reads() -> None:
    with pytest.raises(
        ConfigError, match="data.source='pydoc': model.arch=resnet reads synthetic or imagenet"
    ):
        load_config("resnet_cpu", ["data.source=pydoc"])
    with pytest.raises(ConfigError, match="data.source='imagenet': model.arch=bert reads"):
        load_config("bert_tiny_cpu", ["data.source=imagenet"])
