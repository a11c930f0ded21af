"""The engine's shape: imports point one way, configs import no implementation, folders stay small,
the front ends go through the facade, no threads, backends as data, small family files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from segmented_checkpointing.engine.config.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
MAX_MODULES = 14
"""Modules a folder of engine/ may hold (``__init__.py`` not counted): split by what they hold beyond it."""
LAYERS = {"files": 0, "families": 0, "config": 1, "core": 2, "model": 3, "data": 4, "train": 5, "measure": 6}
"""Lower layers never import higher ones: files, families <- config <- core <- model <- data <- train <- measure
(``files``: reading and writing files safely; it imports no engine module)."""
OPTIONAL_HEAVY = ("matplotlib", "skimage", "torchao", "transformers", "diffusers.modular_pipelines", "av",
                  "torch._dynamo", "prodigyopt", "bitsandbytes")
"""Imported inside the function that needs them: optional, or heavy and needed by one feature."""
HEAVY = ("torch", "diffusers", "peft", "torchao", "transformers", "accelerate", "safetensors")
"""Libraries the declarations (config/, families/) never import at module level, so that ``--help``, a
refused option and the ComfyUI pack's import cost none of them (tests/test_startup.py): a family
file's ``torch`` is ``families/lazy.py``'s, imported on first use; diffusers is imported where a model
class is resolved (``FamilyAdapter.model_cls``)."""
DECLARATIONS = ("config", "families")


def _modules():
    return sorted(p for p in ENGINE.rglob("*.py") if p.parent != ENGINE)


def _layer(path: Path) -> str:
    return path.relative_to(ENGINE).parts[0]


def _imported_layers(path: Path) -> set[str]:
    """Engine layers a module imports (relative imports resolved against its package)."""
    tree, found = ast.parse(path.read_text()), set()
    package = path.relative_to(ENGINE).parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            target = (*base, *(node.module or "").split(".")) if node.module else base
            if target and target[0] in LAYERS:
                found.add(target[0])
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["segmented_checkpointing", "engine"] and len(parts) > 2 and parts[2] in LAYERS:
                    found.add(parts[2])
                if parts[0] in ("comfy", "folder_paths", "server", "nodes", "comfy_execution"):
                    found.add("comfyui")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ENGINE)))
def test_imports_point_one_way(path):
    layer = _layer(path)
    for other in _imported_layers(path):
        assert other != "comfyui", f"{path.name} imports ComfyUI"
        assert LAYERS[other] <= LAYERS[layer], f"{layer}/{path.name} imports from {other}/"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ENGINE)))
def test_no_function_local_imports_but_optional_heavy_ones(path):
    tree = ast.parse(path.read_text())
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            else:
                continue
            allowed = OPTIONAL_HEAVY + (HEAVY if _layer(path) in DECLARATIONS else ())
            assert all(n.split(".")[0] in allowed or n.startswith(allowed) for n in names), \
                f"{path.name}:{node.lineno} {function.name} imports {names} locally"


@pytest.mark.parametrize("path", [p for p in _modules() if _layer(p) in DECLARATIONS],
                         ids=lambda p: str(p.relative_to(ENGINE)))
def test_declarations_import_no_heavy_library_at_module_level(path):
    tree = ast.parse(path.read_text())
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in functions:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        assert not [n for n in names if n.split(".")[0] in HEAVY], f"{path.name}:{node.lineno} imports {names}"


def test_the_facade_imports_only_the_declarations_at_module_level():
    """``engine/api.py`` imports the configs, the family adapters and the support table generated from
    them; every implementation is imported when a function needs it or a re-exported name is read."""
    engine, libraries = set(), set()
    for node in ast.parse((ENGINE / "api.py").read_text()).body:  # the TYPE_CHECKING block is an ast.If
        if isinstance(node, ast.ImportFrom) and node.level:
            engine.add(node.module)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            libraries |= {a.name for a in node.names} if isinstance(node, ast.Import) else {node.module}
    assert all(m.split(".")[0] in DECLARATIONS or m == "core.support" for m in engine), engine
    assert not {m for m in libraries if m.split(".")[0] in HEAVY}, libraries


IMPORT_LOCK = ("families/lazy.py", ("import threading  #", "_IMPORTS = threading.RLock()"))
"""The one use of ``threading`` in the engine: the lock that serialises lazy imports (issue 34), no thread."""


def test_no_threads_or_process_wide_thread_settings():
    pattern = re.compile(r"threading|set_num_threads|sched_setaffinity")
    hits = [f"{p.relative_to(ENGINE)}:{i}" for p in ENGINE.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and not line.lstrip().startswith("#")
            if not (str(p.relative_to(ENGINE)) == IMPORT_LOCK[0] and line.startswith(IMPORT_LOCK[1]))]
    assert hits == []


def _guarded(function: ast.AST) -> set[int]:
    """ids of the statements inside a ``with lazy_imports():`` (or ``api.lazy_imports()``) of ``function``."""
    inside = set()
    for node in ast.walk(function):
        if isinstance(node, ast.With) and any(
                isinstance(item.context_expr, ast.Call)
                and getattr(item.context_expr.func, "id", getattr(item.context_expr.func, "attr", "")) == "lazy_imports"
                for item in node.items):
            inside |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return inside


@pytest.mark.parametrize("path", [*ENGINE.rglob("*.py"), ROOT / "cli.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_function_local_import_runs_under_the_import_lock(path):
    """Issue 34: a lazy import (a heavy library, or an engine module that imports one) may run on several
    threads of a ComfyUI server at once; each goes through ``engine/families/lazy.py``'s ``lazy_imports``."""
    tree = ast.parse(path.read_text())
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        guarded = _guarded(function)
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                assert id(node) in guarded, f"{path.name}:{node.lineno} {function.name}: import outside lazy_imports()"


def test_backend_names_live_in_the_backend_table_only():
    table = ENGINE / "config" / "backends.py"
    hits = []
    for path in ENGINE.rglob("*.py"):
        if path == table:
            continue
        tree = ast.parse(path.read_text())
        versions = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k, v in zip(d.keys, d.values)
                    if isinstance(v, ast.Attribute) and v.attr == "__version__"}  # {"torch": torch.__version__}
        modules = {id(c.args[0]) for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args
                   and isinstance(c.func, ast.Name) and c.func.id == "LazyModule"}  # LazyModule("torch")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in BACKENDS and id(node) not in versions | modules:
                hits.append(f"{path.relative_to(ENGINE)}:{node.lineno} {node.value!r}")
    assert hits == []


def test_lr_schedules_are_told_apart_in_their_table_only():
    """What a learning-rate schedule does is its row of ``LR_SCHEDULES`` (``engine/config/optim.py``):
    no other module compares ``lr_scheduler`` with a name (docs/EXTENDING.md "Add a learning-rate schedule")."""
    table = ENGINE / "config" / "optim.py"
    hits = [f"{path.relative_to(ENGINE)}:{node.lineno}" for path in ENGINE.rglob("*.py") if path != table
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)
            and any(isinstance(n, ast.Attribute) and n.attr == "lr_scheduler" for n in (node.left, *node.comparators))]
    assert hits == []


@pytest.mark.parametrize("path", sorted((ENGINE / "families").rglob("*.py")), ids=lambda p: p.name)
def test_family_files_are_small_and_document_briefly(path):
    text = path.read_text()
    assert len(text.splitlines()) < 150
    docstring = ast.get_docstring(ast.parse(text)) or ""
    assert len(docstring.splitlines()) <= 8 or path.name in ("__init__.py", "base.py", "packing.py")


def test_an_unrouted_list_is_a_field_of_the_plan_not_a_note():
    from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
    from segmented_checkpointing.engine.core.plan import effective_plan
    from segmented_checkpointing.engine.families import get_family

    family = get_family("lumina2")  # its refiner lists are called directly, never through the hook
    counts = {bl.name: 3 for bl in family.block_lists}
    plan = effective_plan(family, CheckpointSchedule(gradient_checkpointing_offload_attention=True), counts,
                          warn=False)
    routed = {p.name: p.routed for p in plan.lists}
    assert routed == {bl.name: bl.routed for bl in family.block_lists} and False in routed.values()
    for listed in plan.lists:
        assert bool(listed.segments) == listed.routed
        assert plan.block_maps()[listed.name] == ("CCC" if listed.routed else "...")  # no "a" where nothing runs
    assert [entry["routed"] for entry in plan.to_dict()["lists"]] == list(routed.values())


def test_no_folder_of_the_engine_holds_more_than_14_modules():
    crowded = {str(folder.relative_to(ENGINE)): n for folder in [ENGINE, *ENGINE.rglob("*")] if folder.is_dir()
               if (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert crowded == {}


def _engine_imports(path: Path, package: tuple[str, ...]) -> set[str]:
    """The engine modules (dotted, from ``engine``) a file imports; ``package``: the file's own
    package, from the repository root."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = (*base, *(node.module or "").split(".")) if node.module else base
            else:
                parts = (node.module or "").split(".")
                target = tuple(parts[1:]) if parts[0] == "segmented_checkpointing" else ()
            if target[:1] == ("engine",):
                names = [a.name for a in node.names]
                # "from ..engine import api" imports the module engine.api
                found |= {".".join((*target, n)) for n in names} if len(target) == 1 else {".".join(target)}
    return found


def test_configs_import_no_implementation_module():
    """The option declarations sit below everything that uses them: a config module imports other
    configs, the family registry and the file readers (``engine/files``: config files are text),
    nothing that builds, trains or measures."""
    for path in sorted((ENGINE / "config").glob("*.py")):
        imported = _engine_imports(path, ("engine", "config"))
        assert all(m.startswith(("engine.config", "engine.families", "engine.files")) for m in imported), \
            (path.name, imported)


@pytest.mark.parametrize("path", [ROOT / "cli.py", *sorted((ROOT / "nodes").glob("*.py"))],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_front_ends_import_the_facade_and_at_most_one_more_engine_module(path):
    package = ("nodes",) if path.parent.name == "nodes" else ()
    imported = _engine_imports(path, package)
    assert len(imported) <= 2 and (not imported or "engine.api" in imported), imported


def test_the_facade_offers_every_entry_point():
    from segmented_checkpointing.engine import api

    for name in ("train", "check_fit", "plan", "sweep", "load_model", "families"):
        assert callable(getattr(api, name)), name
    assert not hasattr(__import__("segmented_checkpointing.engine.measure", fromlist=["x"]), "guarded")


def _diagram() -> dict[str, set[str]]:
    """The modules ARCHITECTURE.md's diagram lists, by folder (continuation lines belong to the folder above)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("```")[1]
    listed: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        words = line.split()
        if words and words[0].startswith("engine/"):
            folder = words[0].rstrip("/")
            words = words[1:]
        if folder is not None and words and not set(line.strip()) <= {"|"}:
            listed.setdefault(folder, set()).update(w for w in words if w.endswith((".py", "/")))
    return listed


def test_architecture_md_names_every_module_and_only_existing_ones():
    listed = _diagram()
    for folder, names in listed.items():
        for name in names:
            assert (ROOT / folder / name.rstrip("/")).exists() or (ROOT / folder).is_file(), f"{folder}/{name}"
    layered = {folder for folder in listed if (ROOT / folder).is_dir()}
    for path in _modules():
        folder = path.parent.relative_to(ROOT).as_posix()
        if folder.startswith("engine/families/"):  # a family adapter: its kind's folder is listed
            assert f"{path.parent.name}/" in listed["engine/families"], folder
            continue
        if path.name == "__init__.py":
            continue
        assert folder in layered and path.name in listed[folder], f"{folder}/{path.name} is not in ARCHITECTURE.md"
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for named in re.findall(r"`(engine/[\w/<>.-]+\.py)`", text):
        if "<" not in named:
            assert (ROOT / named).is_file(), named


# The run's state in named parts (issue 37 item 3): measured with ast, as the issue measured it.

RUN_ATTRIBUTES = 12
"""Instance attributes ``TrainingRun`` may hold (``self.x = ...`` anywhere in the class): a few named parts."""
LOOP_LINES = 300
"""Lines of ``engine/train/loop.py``: the loop reads top to bottom; set-up, outputs and checks live beside it."""
RECORD_FIELDS = 18
"""Fields of ``StepRecord``: the step's outcome flat, its measurements in the groups of ``RECORD_GROUPS``."""
WHOLE_CONFIG_FUNCTIONS = 15
"""Functions of the engine that take the whole ``TrainConfig``; the rest take the component they read."""
FUNCTION_LINES = 60
"""Lines of any function of the engine, its docstring included (``def`` line to its last line)."""
PARAMETERS = 8
"""Declared parameters of any function of the engine: positional, keyword-only, ``*args`` and ``**kwargs``
each count one; ``self`` and ``cls`` (the first parameter of a method) do not."""
CONFIG_OWN = "config/train.py"
"""``TrainConfig``'s own module: its constructors and readers take the config they build; not counted."""


def _functions() -> list[tuple[str, ast.FunctionDef]]:
    """Every function of the engine, methods and nested ones included, as ``("<folder>/<file>:<Class>.<name>", node)``."""
    found = []

    def visit(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{rel}:{prefix}{child.name}", child))
            named = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            visit(child, rel, f"{prefix}{child.name}." if named else prefix)

    for path in sorted(ENGINE.rglob("*.py")):
        visit(ast.parse(path.read_text()), path.relative_to(ENGINE).as_posix(), "")
    return found


def _parameters(function: ast.FunctionDef) -> list[ast.arg]:
    """The declared parameters of ``function`` (see :data:`PARAMETERS`)."""
    args = function.args
    positional = [*args.posonlyargs, *args.args]
    if positional and positional[0].arg in ("self", "cls"):
        positional = positional[1:]
    return positional + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a is not None]


def _class_of(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_training_run_holds_a_few_named_parts():
    run = _class_of(ENGINE / "train" / "loop.py", "TrainingRun")
    attributes = {n.attr for n in ast.walk(run) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert len(attributes) <= RUN_ATTRIBUTES, sorted(attributes)
    lines = len((ENGINE / "train" / "loop.py").read_text().splitlines())
    assert lines <= LOOP_LINES, f"engine/train/loop.py has {lines} lines"


def test_a_step_record_groups_its_measurements():
    """``StepRecord``'s measurements are nested dataclasses, one per group; report.json's steps hold
    their fields flat (tests/train read them by their old names)."""
    from segmented_checkpointing.engine.train.records import RECORD_GROUPS, StepRecord

    record = _class_of(ENGINE / "train" / "records.py", "StepRecord")
    names = [n.target.id for n in record.body if isinstance(n, ast.AnnAssign)]
    assert len(names) <= RECORD_FIELDS, names
    assert set(RECORD_GROUPS) <= set(names)
    assert set(RECORD_GROUPS) == {"timing", "memory", "checkpointing", "streaming", "saving", "compile"}
    flat = StepRecord(3, 0.5, 1e-4).to_dict()
    assert not set(RECORD_GROUPS) & set(flat) and {"seconds", "peak_bytes", "weight_h2d_bytes", "compiled_graphs",
                                                      "saved_attention_bytes", "recomputed_blocks"} <= set(flat)


def _takes_whole_config(function: ast.FunctionDef) -> bool:
    """A parameter annotated ``TrainConfig`` (alone or in a union), or an unannotated one named ``config``."""
    return any((a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation))
               or (a.annotation is None and a.arg == "config") for a in _parameters(function))


def test_few_functions_take_the_whole_config():
    whole = [name for name, f in _functions() if _takes_whole_config(f) and not name.startswith(CONFIG_OWN)]
    assert len(whole) <= WHOLE_CONFIG_FUNCTIONS, whole


def test_no_function_is_long_or_takes_many_parameters():
    long, many = [], []
    for name, function in _functions():
        lines = function.end_lineno - function.lineno + 1
        if lines > FUNCTION_LINES:
            long.append(f"{name} ({lines} lines)")
        count = len(_parameters(function))
        if count > PARAMETERS:
            many.append(f"{name} ({count} parameters)")
    assert not long and not many, long + many


def _module_graph() -> dict[str, set[str]]:
    """Each engine module (``train.loop``, a package as its ``__init__``) and the engine modules it
    imports anywhere, ``TYPE_CHECKING`` blocks and function bodies included."""
    modules = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ENGINE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                found |= {t for t in [target, *(f"{target}.{a.name}".strip(".") for a in node.names)] if t in modules}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found |= {n.removeprefix("segmented_checkpointing.engine.") for n in names} & set(modules)
        graph[name] = found - {name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(tuple(sorted(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_engine_imports_form_no_circle():
    """Type-only imports count: a circle under ``TYPE_CHECKING`` is still two modules that need each other."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]  # the finder finds one
    assert not _circles(_module_graph())
