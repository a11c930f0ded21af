"""Family adapters. Importing this package registers every family: each module in this folder
(except the shared helpers in ``_HELPERS``) declares one adapter with :func:`register_family`."""

import importlib
import pkgutil

from .base import (  # noqa: F401
    BlockList,
    Carry,
    FamilyAdapter,
    TextBatch,
    TextSpec,
    family_for_class,
    family_names,
    get_family,
    register_family,
)

_HELPERS = ("base", "blocks", "conditioning", "packing", "registry", "timesteps")

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _HELPERS:
        importlib.import_module(f"{__name__}.{_module}")
