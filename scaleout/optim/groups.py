"""Parameter groups by name pattern: which tensors get weight decay and the trust ratio.

Which names are excluded is model knowledge, so each model family declares it (``Family.no_decay``,
scaleout/families/): NVIDIA's BERT (DeepLearningExamples, run_pretraining.py) puts every parameter
whose name contains ``bias``, ``gamma``, ``beta`` or ``LayerNorm`` in a group with weight decay 0,
and FusedLAMB applies the trust ratio only where weight decay is non-zero; the MLPerf ResNet LARS
reference skips decay and adaptation for ``batch_normalization`` and ``bias`` variables. PyTorch
names batch-norm parameters after the attribute (``bn1.weight``, ``downsample.1.weight``), so
besides name patterns the parameters of normalisation modules are excluded by type
(``norm_layers=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from scaleout.errors import ConfigError
from scaleout.families.base import Family

__all__ = ["GENERIC_NO_DECAY", "param_groups"]

# Without a family's patterns (Family.no_decay): biases only, besides normalisation layers by type.
GENERIC_NO_DECAY: tuple[str, ...] = Family.no_decay
_NORM_TYPES = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
)


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    no_decay: Sequence[str] = GENERIC_NO_DECAY,
    norm_layers: bool = True,
    **group_opts: Any,
) -> list[dict[str, Any]]:
    """Two groups: decayed and adapted tensors, and excluded ones (weight_decay 0, trust_ratio
    False).

    A parameter is excluded when a ``no_decay`` pattern is a substring of its qualified name
    (NVIDIA's rule) or, with ``norm_layers``, when it belongs to a normalisation module. Frozen
    parameters are left out; tied parameters appear once. ``group_opts`` (e.g. lr) are copied into
    both groups. Each group also carries ``names`` so that a reader of the optimizer can see what
    went where.
    """
    if isinstance(no_decay, str):
        raise ConfigError(
            f"no_decay={no_decay!r} must be a sequence of name patterns, e.g. ({no_decay!r},)"
        )
    norm_params: set[int] = set()
    if norm_layers:
        for mod in model.modules():
            if isinstance(mod, _NORM_TYPES):
                norm_params.update(id(p) for p in mod.parameters(recurse=False))
    decay: list[tuple[str, torch.nn.Parameter]] = []
    skip: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        excluded = id(p) in norm_params or any(pat in name for pat in no_decay)
        (skip if excluded else decay).append((name, p))
    if not decay and not skip:
        raise ConfigError(f"{type(model).__name__} has no trainable parameters to optimise")
    groups = []
    for members, wd, adapt in ((decay, weight_decay, True), (skip, 0.0, False)):
        if members:
            groups.append(
                {
                    "params": [p for _, p in members],
                    "names": [n for n, _ in members],
                    "weight_decay": wd,
                    "trust_ratio": adapt,
                    **group_opts,
                }
            )
    return groups
