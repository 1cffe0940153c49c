"""A pydantic ValidationError -> one line that names the key and what was expected (torch-free).

Shared by the loader (the whole tree: ``optim.lr='abc': expected a valid number``) and by the
schema's composed sections (``model.bert.hidden=100: ...``, validated when a config is).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from scaleout.errors import EXCERPT_CHARS, excerpt


def allowed_keys(root: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys of the section that ``loc`` (an error's location below ``root``) ends in."""
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def describe(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    """The first error of ``exc`` (raised validating ``root`` at the key ``prefix``) in one line."""
    err = exc.errors()[0]
    loc = tuple(err.get("loc", ()))
    key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "<root>"
    if err["type"] == "extra_forbidden":
        allowed = allowed_keys(root, loc)
        hint = f" (expected one of: {', '.join(allowed)})" if allowed else ""
        shown = key if len(key) <= EXCERPT_CHARS else excerpt(key)  # a key is a name, not a value
        msg = f"unknown key {shown}{hint}"
    else:
        value = err.get("input")
        shown = excerpt(value) if not isinstance(value, dict) else "a mapping"
        text = err["msg"]
        if text.startswith("Value error, "):
            msg = text[len("Value error, ") :]  # our validators already name the key
        else:
            text = text.removeprefix("Input should be ").removeprefix("input should be ")
            msg = f"{key}={shown}: expected {text[0].lower() + text[1:]}"
    more = len(exc.errors()) - 1
    return msg + (f" (+{more} more)" if more > 0 else "")
