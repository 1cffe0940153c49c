"""A checkpoint that does not fit the resuming run's model or optimizer: one line naming the rank,
the file and what differs (scaleout/train/resume_check.py), built from real modules and real
``torch.optim`` state: a layer more or fewer, a wider layer, another optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scaleout.errors import ConfigError
from scaleout.train.resume_check import load_or_explain, model_mismatch


def _mlp(layers: int, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _state(model: torch.nn.Module, opt_cls=torch.optim.Adam) -> dict:
    opt = opt_cls(model.parameters(), lr=0.1)
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


CASES = [
    # (id, saved model, resuming model, what the line says)
    (
        "one-layer-more",
        _mlp(2),
        _mlp(3),
        "2 tensors of this model are not in it (2.weight, 2.bias)",
    ),
    ("one-layer-fewer", _mlp(3), _mlp(2), "2 of its tensors are not in this model"),
    ("wider", _mlp(2, 8), _mlp(2, 16), "0.weight: saved [8, 8], this model [16, 16]"),
]


@pytest.mark.unit
@pytest.mark.parametrize("saved,mine,said", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_changed_model_is_one_line_naming_what_differs(saved, mine, said) -> None:
    state = {"model": saved.state_dict()}
    loaded = []
    with pytest.raises(ConfigError) as err:
        load_or_explain(lambda: loaded.append(1), state, mine, Path("ck/ckpt-00000002.pt"), 3)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("rank 3: checkpoint ck/ckpt-00000002.pt was written by another model")
    assert said in line, line
    assert not loaded  # nothing half-loaded


@pytest.mark.unit
def test_a_changed_optimizer_is_one_line_not_a_traceback() -> None:
    """An SGD-with-momentum state given to Adam: torch's own error, as one line naming the rank."""
    model = _mlp(2)
    state = _state(model, lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    adam = torch.optim.Adam(_mlp(2).parameters(), lr=0.1)
    adam.param_groups[0]["params"] = adam.param_groups[0]["params"][:1]  # another grouping

    with pytest.raises(ConfigError) as err:
        load_or_explain(
            lambda: adam.load_state_dict(state["optimizer"]), state, model, Path("c.pt"), 0
        )
    assert str(err.value).startswith("rank 0: checkpoint c.pt does not fit")
    assert "ValueError" in str(err.value)


@pytest.mark.unit
def test_a_fitting_checkpoint_loads() -> None:
    model = _mlp(2)
    state = {"model": model.state_dict()}
    loaded = []
    load_or_explain(lambda: loaded.append(1), state, _mlp(2), Path("c.pt"), 0)
    assert loaded == [1]
    assert model_mismatch(state["model"], _mlp(2)) is None
