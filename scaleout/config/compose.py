"""The ``model`` section, composed from the families' declarations when a config is validated
(torch-free), and the lookups the schema's validators share.

The families and algorithms are read from the tables of scaleout/section.py (the leaf below this
package and the extensions). :func:`declared` imports the built-in declarations
(``scaleout.families``, ``scaleout.comm``) the first time a config is validated; importing this
module does not, and nothing there imports ``scaleout.config`` back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from scaleout.config.oneline import describe
from scaleout.errors import ConfigError
from scaleout.registry import Registry
from scaleout.section import ALGORITHMS, FAMILIES, Section

if TYPE_CHECKING:
    from scaleout.families import Family


def declared() -> tuple[Registry[Any], Registry[Any]]:
    """The tables of families and algorithms, with the built-in ones declared (imported once, at
    the first validation: importing this module imports neither package)."""
    import scaleout.comm  # noqa: F401  # deferred: the built-in algorithms' declarations
    import scaleout.families  # noqa: F401  # deferred: the built-in families' declarations

    return FAMILIES, ALGORITHMS


def one_of(names: tuple[str, ...] | list[str]) -> str:
    """``'a', 'b' or 'c'``: the choices as a one-line error lists them."""
    quoted = [repr(n) for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def section_value(cls: type[Section], value: Any, key: str) -> Section:
    """``value`` validated as the section ``cls`` at ``key``: one line naming the key if not."""
    if isinstance(value, cls):
        return value
    try:
        return cls.model_validate(value)
    except ValidationError as exc:
        raise ValueError(describe(exc, cls, f"{key}.")) from None


class ModelConfig(Section):
    """``model``: ``arch`` (a registered family's name, scaleout/families/), one section per family
    that declares one (``model.bert``, ``model.resnet``: each family's config.py; composed when
    validated, see the module docstring), then the common keys."""

    # the family sections are the only extra keys: _family_sections rejects any other one
    model_config = ConfigDict(extra="allow")

    arch: str = "bert"
    # BERT weights to start from (MLPerf phase 2 starts from the phase-1 checkpoint): a Hugging
    # Face BertForPreTraining state dict or NVIDIA's MLPerf checkpoint ({"model": ...}); see
    # scaleout/families/bert/convert.py
    init_checkpoint: str | None = None
    compile: bool = False  # torch.compile the model
    cuda_graphs: bool = False  # capture the step in a CUDA graph (GPU only; ignored on CPU)

    @model_validator(mode="before")
    @classmethod
    def _family_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not a mapping: pydantic's own one-line error
        families, _ = declared()
        sections = {name: fam.config for name, fam in families.items() if fam.config is not None}
        for key in data:
            if key not in cls.model_fields and key not in sections:
                known = ", ".join([*cls.model_fields, *sections])
                raise ValueError(f"unknown key model.{key} (expected one of: {known})")
        out = dict(data)
        for name, section in sections.items():
            out[name] = section_value(section, data.get(name, {}), f"model.{name}")
        return out

    @field_validator("arch")
    @classmethod
    def _registered_arch(cls, name: str) -> str:
        families, _ = declared()
        if name not in families:
            raise ValueError(f"model.arch={name!r}: expected {one_of(families.names())}")
        return name

    @property
    def family(self) -> Family:
        """The family of ``arch`` (validated above): the object every consumer of a config calls,
        so the name is looked up here and nowhere else."""
        return declared()[0].get(self.arch)

    def __setattr__(self, name: str, value: Any) -> None:
        # cfg.model.<family> = ... is validated as that family's section, like any other key
        if name in self.__pydantic_extra__:
            section = type(self.__pydantic_extra__[name])
            try:
                value = section_value(section, value, f"model.{name}")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif name not in type(self).model_fields and not name.startswith("_"):
            raise ConfigError(f"unknown key model.{name}")
        super().__setattr__(name, value)
