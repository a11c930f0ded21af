"""Family adapters. Importing this package registers every family: each module of the subpackages
(``mmdit/``, ``dit/``, ``video/``, ``unet/``) declares one adapter with :func:`register_family`; the
modules of this folder are the shared declarations and helpers."""

import importlib
import pkgutil

from .base import BlockList, Carry, FamilyAdapter, TextBatch, TextSpec  # noqa: F401
from .registry import family_for_class, family_names, get_family, register_family  # noqa: F401

KINDS = ("mmdit", "dit", "video", "unet")
"""The subpackages of family adapters, one module per family in each."""

for _kind in KINDS:
    _package = importlib.import_module(f"{__name__}.{_kind}")
    for _module in sorted(m.name for m in pkgutil.iter_modules(_package.__path__)):
        importlib.import_module(f"{__name__}.{_kind}.{_module}")
