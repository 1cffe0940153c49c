"""Model families: the extension point of what is trained (``model.arch``).

A family is one folder, ``scaleout/families/<name>/``, whose ``__init__.py`` registers a
:class:`Family` in :data:`FAMILIES`. What the config schema, the simulator, the report and the
MLPerf log read from a family is torch-free (its name, config section, FLOP and parameter formulas,
benchmark and metric names, checks): importing this package never imports torch. The runtime (model,
data, the task) is imported when :meth:`Family.build_task` runs, inside a rank. See
docs/extending.md.
"""

from __future__ import annotations

# The built-in families register themselves on import (torch-free declarations); the protocol and
# the registry they register in live in scaleout.families.base.
# Registration order is the order users see them in (tables, errors, docs): BERT's and ResNet's
# benchmarks first, then their successor.
# isort: off
from scaleout.families import bert as _bert  # noqa: F401
from scaleout.families import resnet as _resnet  # noqa: F401
from scaleout.families import llama as _llama  # noqa: F401

# isort: on
from scaleout.families.base import FAMILIES, Family, data_sources, register, unregister

__all__ = ["FAMILIES", "Family", "data_sources", "register", "unregister"]
