"""The leaf below both the config schema and the extensions that declare config sections: the
pydantic :class:`Section` base and the two tables of declarations, :data:`FAMILIES` (``model.arch``)
and :data:`ALGORITHMS` (``comm.algorithm``).

Arrows point down. A model family registers its torch-free declaration (its ``model.<name>``
section class, the data sources it reads, its world checks) in :data:`FAMILIES` when its package is
imported (scaleout/families/<name>/); an all-reduce algorithm registers its declaration (its
``Options``: the ``comm.*`` keys it reads) in :data:`ALGORITHMS` (scaleout/comm/<name>.py).
``scaleout.config.schema`` reads the same tables when a config is validated: its classes are built
once at import and never change, and it imports neither ``scaleout.families`` nor ``scaleout.comm``
(which re-export these tables under the names they always had).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from scaleout.registry import Registry

if TYPE_CHECKING:
    from scaleout.comm.algorithm import Algorithm
    from scaleout.families import Family

# Upper bound of world sizes (and of anything counted in ranks, such as model.resnet.bn_group):
# rejects a typo with one line before anything is spawned; the largest machines have ~10^5
# accelerators.
MAX_WORLD = 1 << 20


class Section(BaseModel):
    """extra="forbid": an unknown key is an error that names it."""

    # allow_inf_nan=False: lr=.inf or step_timeout_s=.inf would pass gt=0 and fail in every rank
    # later.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# The model families by model.arch (each Family's ``config`` is its model.<name> section).
FAMILIES: Registry[Family] = Registry("model family")
# The all-reduce algorithms by comm.algorithm (each Algorithm's ``Options`` says which comm.* keys
# it reads).
ALGORITHMS: Registry[Algorithm] = Registry("all-reduce algorithm")
