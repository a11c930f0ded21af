"""The family registry: every family file registers its adapter here with one explicit call."""

from __future__ import annotations

from .base import FamilyAdapter

_REGISTRY: dict[str, FamilyAdapter] = {}


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    """Register ``adapter`` under its name (one explicit call per family file).

    Raises:
        ValueError: a different adapter is already registered under that name.
    """
    existing = _REGISTRY.get(adapter.name)
    if existing is not None and existing is not adapter:
        raise ValueError(f"family {adapter.name!r} is already registered")
    _REGISTRY[adapter.name] = adapter
    return adapter


def get_family(name: str) -> FamilyAdapter:
    """The adapter registered as ``name`` (case-insensitive).

    Raises:
        KeyError: unknown family; the message lists the known ones.
    """
    key = name.lower()
    if key not in _REGISTRY:
        raise KeyError(f"family={name!r} is unknown: allowed {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key]


def family_names() -> list[str]:
    """Names of all registered families, sorted."""
    return sorted(_REGISTRY)


def family_for_class(class_name: str) -> FamilyAdapter | None:
    """The adapter whose diffusers class is ``class_name``, if any."""
    for adapter in _REGISTRY.values():
        if adapter.model_class == class_name:
            return adapter
    return None
