"""``torch`` for the family adapters, imported on its first use.

A family file declares data at import (docs/SCHEDULES.md "A family declares") and touches torch only
inside the functions that run a model (``make_inputs``, ``read_output``, the packing helpers). Its
``from ..lazy import torch`` keeps it so: the options' metadata, ``segckpt --help``, a refused
config and the support matrix import every adapter without importing torch
(``tests/test_startup.py``). Unlike ``importlib.util.LazyLoader`` this puts nothing in
``sys.modules``: any other ``import torch`` is the ordinary one.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it on the first attribute read and then
    forwards every read to it (``torch.zeros`` is the real ``torch.zeros``).

    Raises:
        ImportError: on the first read, when the module cannot be imported.
        AttributeError: the module has no such attribute.
    """

    def __getattr__(self, attribute: str) -> Any:
        module = sys.modules.get(self.__name__) or importlib.import_module(self.__name__)
        return getattr(module, attribute)


torch = LazyModule("torch")
"""The ``torch`` module, imported when an adapter's function first uses it."""
