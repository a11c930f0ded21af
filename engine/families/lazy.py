"""Every lazy import of the engine, in one place: one thread at a time, retried after a failure.

A family file touches torch only inside the functions that run a model; its ``from ..lazy import
torch`` keeps ``--help``, a refused config and the support matrix free of torch
(``tests/test_startup.py``). Unlike ``importlib.util.LazyLoader`` this puts nothing in
``sys.modules``. Every other import that is not at a module's top runs inside
:func:`lazy_imports` (``tests/test_architecture.py``), whose docstring says why.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import threading  # a lock around imports, not a thread: the engine starts none and sets no thread count
import types
from typing import Any, Iterator

_IMPORTS = threading.RLock()
"""Held while a lazy import runs. Import state (``sys.modules``) is process-wide, so this lock is
too (module-level on purpose; it holds nothing of a run). Re-entrant: a guarded import may run
code that imports lazily again (a facade function's implementation)."""


@contextlib.contextmanager
def lazy_imports() -> Iterator[None]:
    """Run the ``import`` statements of the block one thread at a time, undone when they fail.

    The heavy libraries (torch, diffusers and what it pulls in: accelerate, peft, transformers;
    torchao, gguf, PyAV, matplotlib) are imported on first use, and a ComfyUI server may first use
    them from several threads at once (the plan route answers on worker threads while a training
    runs on the executor's). Python's per-module import locks do not make that safe for packages
    with import cycles: when two threads import one cycle, the deadlock detector hands one of them
    a partially initialised module (diffusers' lazy classes -> ``diffusers.loaders.peft`` ->
    accelerate's ``big_modeling`` <-> ``utils.bnb``), that import fails, and the half-imported
    modules it leaves in ``sys.modules`` fail every later import until the process restarts
    (issue 34). So one re-entrant lock serialises them, and a failed attempt's modules leave
    ``sys.modules``: the next attempt imports them afresh instead of finding them half made.

    Use it around every import that is not at a module's top (a heavy library, or an engine module
    that imports one)::

        with lazy_imports():
            from .measure.preflight import preflight

    Raises:
        whatever the block raises; before it propagates, every module that entered
        ``sys.modules`` inside the block is removed (but packages with compiled extensions, see
        :func:`_forget`), so that a later import retries from scratch.
    """
    with _IMPORTS:
        before = set(sys.modules)
        try:
            yield
        except BaseException:
            _forget(set(sys.modules) - before)
            raise


def _forget(added: set[str]) -> None:
    """Take the modules ``added`` by a failed attempt out of ``sys.modules``, but those of a package
    with a compiled extension among them (``torch`` with ``torch._C``, PyAV, Pillow): an extension
    module is initialised once per process, and importing its package again would register its
    operators twice. Pure-Python packages (diffusers, accelerate, peft, transformers) are the ones
    whose half-made state poisons later imports, and they are imported afresh."""
    native = {name.partition(".")[0] for name in added
              if isinstance(getattr(getattr(sys.modules.get(name), "__spec__", None), "loader", None),
                            importlib.machinery.ExtensionFileLoader)}
    for name in added:
        if name.partition(".")[0] not in native:
            sys.modules.pop(name, None)


def import_module(name: str, package: str | None = None) -> types.ModuleType:
    """``importlib.import_module(name, package)`` inside :func:`lazy_imports`; a module that is
    already fully imported is returned without taking the lock.

    Raises:
        ImportError: the module cannot be imported (nothing of the attempt is left behind).
    """
    absolute = importlib.util.resolve_name(name, package) if name.startswith(".") else name
    module = sys.modules.get(absolute)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        return module
    with lazy_imports():
        return importlib.import_module(absolute)


def import_attribute(module: str, attribute: str) -> Any:
    """``getattr(import_module(module), attribute)``, the read inside :func:`lazy_imports` too: a
    lazy package's attribute read imports its submodule (``diffusers.FluxTransformer2DModel``).

    Raises:
        ImportError: the module cannot be imported. AttributeError: it has no such attribute.
    """
    with lazy_imports():
        return getattr(import_module(module), attribute)


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it on the first attribute read (through
    :func:`import_module`) and then forwards every read to it (``torch.zeros`` is the real
    ``torch.zeros``).

    Raises:
        ImportError: on the first read, when the module cannot be imported.
        AttributeError: the module has no such attribute.
    """

    def __getattr__(self, attribute: str) -> Any:
        return getattr(import_module(self.__name__), attribute)


torch = LazyModule("torch")
"""The ``torch`` module, imported when an adapter's function first uses it."""
