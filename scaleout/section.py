"""The pydantic base of every config section, below both the schema and the plugins that declare
sections.

``scaleout.config.schema`` builds the config tree from it, and a model family declares its section
(``model.<arch>``) with it in its own folder (scaleout/families/<name>/config.py) without importing
the schema, which reads the families' registry.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# Upper bound of world sizes (and of anything counted in ranks, such as model.resnet.bn_group):
# rejects a typo with one line before anything is spawned; the largest machines have ~10^5
# accelerators.
MAX_WORLD = 1 << 20


class Section(BaseModel):
    """extra="forbid": an unknown key is an error that names it."""

    # allow_inf_nan=False: lr=.inf or step_timeout_s=.inf would pass gt=0 and fail in every rank
    # later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
