"""Lazy imports under threads (issue 34): concurrent first imports succeed, a failed one is retried.

``engine/families/lazy.py``'s ``lazy_imports`` is the one place; ``tests/test_architecture.py`` checks
that every import inside a function goes through it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from segmented_checkpointing.engine.families.lazy import import_module, lazy_imports

pytestmark = pytest.mark.heavy
FOUR_THREADS = """
import json, threading
from segmented_checkpointing.engine import api
families = ["wan", "qwenimage", "hunyuanvideo", "sd3"]
start, first, later = threading.Barrier(len(families)), {}, {}

def plan(family, errors):
    try:
        api.plan_for_query({"family": family})
    except Exception as exc:
        errors[family] = repr(exc)[:300]

threads = [threading.Thread(target=plan, args=(f, first)) for f in families]
for t in threads:
    t.start()
for t in threads:
    t.join()
for family in families:  # every later call of the process
    plan(family, later)
print(json.dumps({"first": first, "later": later}))
"""
"""The reproduction of issue 34: a fresh process whose first plans of four families (each a different
diffusers class, one import cycle: diffusers -> loaders.peft -> accelerate) start at one moment."""


def test_four_threads_import_four_families_at_once_five_fresh_processes_in_five():
    runs = [subprocess.Popen([sys.executable, "-c", FOUR_THREADS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for _ in range(5)]
    answers = [run.communicate() for run in runs]
    for run, (out, err) in zip(runs, answers):
        assert run.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"first": {}, "later": {}}


@pytest.fixture
def poisonable(tmp_path, monkeypatch):
    """A package whose import fails while a marker file exists, leaving behind (without the clean-up)
    a submodule that cached the failure: the shape of accelerate's half-imported cycle."""
    package = tmp_path / "poisonable_pkg"
    package.mkdir()
    marker = tmp_path / "fail"
    (package / "__init__.py").write_text(textwrap.dedent("""
        from .helper import VALUE
        if VALUE is None:
            raise ImportError("poisoned: helper cached a failed import")
    """))
    (package / "helper.py").write_text(textwrap.dedent("""
        try:
            from .config import VALUE
        except ImportError:
            VALUE = None  # a module that imported despite its dependency failing
    """))
    (package / "config.py").write_text(textwrap.dedent(f"""
        import os
        if os.path.exists({str(marker)!r}):
            raise ImportError("transient failure")
        VALUE = 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    marker.write_text("")
    yield marker
    for name in [n for n in sys.modules if n.startswith("poisonable_pkg")]:
        del sys.modules[name]


def test_a_failed_lazy_import_is_retried_afresh_not_poisoned(poisonable):
    with pytest.raises(ImportError, match="poisoned"):
        import_module("poisonable_pkg")
    assert not [n for n in sys.modules if n.startswith("poisonable_pkg")]  # nothing of the attempt is left
    poisonable.unlink()  # the cause goes away: the next import succeeds
    assert import_module("poisonable_pkg").VALUE == 42


def test_lazy_imports_undoes_the_modules_of_a_failed_block_and_reraises(poisonable):
    with pytest.raises(ImportError, match="poisoned"):
        with lazy_imports():
            import poisonable_pkg  # noqa: F401
    assert "poisonable_pkg.helper" not in sys.modules
    poisonable.unlink()
    with lazy_imports():
        from poisonable_pkg import VALUE
    assert VALUE == 42


@pytest.mark.skipif(importlib.util.find_spec("xxlimited") is None, reason="CPython's xxlimited extension is absent")
def test_a_failed_attempt_keeps_the_packages_with_compiled_extensions_it_imported(tmp_path, monkeypatch):
    """An extension module is initialised once per process (torch's operators would register twice):
    a failed attempt that imported one keeps its package, and takes out the pure-Python rest."""
    (tmp_path / "fails_after_native.py").write_text("import xxlimited\nimport json\nraise ImportError('late')\n")
    (tmp_path / "pure_helper.py").write_text("VALUE = 1\n")
    (tmp_path / "fails_after_pure.py").write_text("import pure_helper\nraise ImportError('late')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "xxlimited", raising=False)
    for name in ("fails_after_native", "fails_after_pure"):
        with pytest.raises(ImportError, match="late"):
            import_module(name)
    assert "xxlimited" in sys.modules and "pure_helper" not in sys.modules
