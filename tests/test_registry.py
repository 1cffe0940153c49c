"""The extension points' registry: names in registration order, collisions refused, lookups
named."""

import pytest
from pydantic import BaseModel, ValidationError

from scaleout.registry import Registry, RegistryError

pytestmark = pytest.mark.unit


def test_registry_refuses_a_taken_name_and_names_unknown_ones():
    reg: Registry[int] = Registry("toy thing")
    reg.register("a", 1)
    reg.decorator("b")(2)
    assert reg.names() == ("a", "b") and reg.get("b") == 2 and "a" in reg
    with pytest.raises(RegistryError, match="toy thing 'a' is already registered"):
        reg.register("a", 3)
    assert reg.get("a") == 1  # the first registration stands
    with pytest.raises(RegistryError, match="unknown toy thing 'c': expected one of a, b"):
        reg.get("c")
    reg.unregister("b")
    assert reg.names() == ("a",)


def test_registry_literal_is_a_pydantic_choice():
    reg: Registry[int] = Registry("toy thing")
    reg.register("x", 1)
    reg.register("y", 2)

    class Section(BaseModel):
        kind: reg.literal("auto")  # type: ignore[valid-type]

    assert Section(kind="y").kind == "y" and Section(kind="auto").kind == "auto"
    with pytest.raises(ValidationError):
        Section(kind="z")
