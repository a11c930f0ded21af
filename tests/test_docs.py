"""The documentation points inside the repository, at code that exists.

* No file cites the outside documents the project was built from; their facts are restated in
  docs/SCHEDULES.md, which the docstrings cite instead.
* Every repository path named in a Python docstring or comment, or in a markdown file, exists
  (``*`` globs and ``<family>``-style placeholders allowed).
* Every Sphinx role in the docstrings of engine/, nodes/ and cli.py (``:func:`~.plan.effective_plan```)
  names a module that imports and attributes it has: relative targets are resolved against the
  module's package (``..`` goes up), bare names against the module's namespace and its classes.
* README.md is what a newcomer reads (issue 37): at most 150 lines, its test command the one
  ``.ci/run`` runs, and every section moved out of it to docs/ reachable from it by a link; every
  relative link of the markdown files names a file that exists, and a heading there when it names
  an anchor.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import subprocess
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "segmented_checkpointing"
OUTSIDE = re.compile(r"SPEC\.md|seeds/\d")
PATH = re.compile(r"(?<![\w/.-])((?:engine|nodes|tests)/[\w/*<>.-]*\.py|docs/[\w/*<>.-]*\.md|web/[\w/*<>.-]*\.js"
                  r"|(?:bench|workflows)/[\w/*<>.-]*)")
OUTPUTS = {"bench/gpu_sweep_results.md", "bench/gpu_check_results.md"}
"""Paths the bench scripts write (their default ``--out``); named in docs, never shipped."""
ROLE = re.compile(r":(mod|func|class|meth|data|attr|exc):`~?([\w.]+)`")


def _files(*suffixes: str) -> list[Path]:
    """The repository's files (tracked, and new ones git does not ignore) ending with ``suffixes``."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [ROOT / f for f in listed if f.endswith(suffixes) and not f.startswith(".venv/") and (ROOT / f).is_file()]


def _docstrings(tree: ast.AST) -> list[tuple[str, tuple[str, ...]]]:
    """Every string statement (module, class, function and attribute docstrings) with the names
    of the classes around it."""
    found = []

    def visit(node, classes):
        for child in ast.iter_child_nodes(node):
            value = child.value if isinstance(child, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append((value.value, classes))
            visit(child, (*classes, child.name) if isinstance(child, ast.ClassDef) else classes)
    visit(tree, ())
    return found


def _prose(path: Path) -> str:
    """A markdown file's text, or a Python file's docstrings and comments."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
    return "\n".join([doc for doc, _ in _docstrings(ast.parse(text))] + comments)


def test_no_file_cites_the_outside_documents():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _files(".py", ".md", ".js")
            for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert hits == []


def test_every_path_named_in_the_docs_exists():
    missing = []
    for path in _files(".py", ".md"):
        for named in {m.rstrip(".,") for m in PATH.findall(_prose(path))} - OUTPUTS:
            if not any(ROOT.glob(re.sub(r"<[^>]*>", "*", named).rstrip("/"))):
                missing.append(f"{path.relative_to(ROOT)}: {named}")
    assert sorted(missing) == []


def _has(obj, name: str) -> bool:
    """``obj.name`` exists; on a class also a field (annotation) or an attribute its methods set on ``self``."""
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    # (a module type's __annotations__ is a descriptor, not a dict: LazyModule subclasses ModuleType)
    if any(name in annotations for k in obj.__mro__ if isinstance(annotations := vars(k).get("__annotations__"), dict)):
        return True
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    return any(isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == name
               and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(tree))


def _resolves(dotted: str) -> bool:
    """The longest importable prefix of ``dotted`` is a module that has the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not _has(obj, name):
                return False
            obj = getattr(obj, name, None)
        return True
    return False


def _front_and_engine_modules() -> list[Path]:
    return [ROOT / "cli.py", *sorted((ROOT / "engine").rglob("*.py")), *sorted((ROOT / "nodes").rglob("*.py"))]


@pytest.mark.parametrize("path", _front_and_engine_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_sphinx_role_targets_resolve(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))
    package = name if parts[-1] == "__init__" else name.rpartition(".")[0]
    importlib.import_module(name)  # the module itself imports
    broken = []
    for doc, classes in _docstrings(ast.parse(path.read_text())):
        for role, target in ROLE.findall(doc):
            if target.startswith("."):
                dots = len(target) - len(target.lstrip("."))
                base = package.split(".")[: len(package.split(".")) - dots + 1]
                ok = _resolves(".".join((*base, target.lstrip("."))))
            elif target.startswith(PACKAGE + "."):
                ok = _resolves(target)
            else:  # a bare name: the enclosing classes', then the module's, else an importable module
                scopes = [".".join((name, *classes[:i])) for i in range(len(classes), 0, -1)] + [name]
                first = target.split(".")[0]
                owner = next((s for s in scopes if _resolves(f"{s}.{first}")), None)
                ok = _resolves(f"{owner}.{target}") if owner else "." in target and _resolves(target)
            if not ok:
                broken.append(f":{role}:`{target}`")
    assert broken == []


def test_the_schedules_page_names_every_family_the_support_matrix_maps():
    from segmented_checkpointing.engine.core.support import DOCUMENT_FAMILIES

    page = (ROOT / "docs" / "SCHEDULES.md").read_text()
    section = page.split('## Families named by the documents')[1].split("\n## ")[0]
    assert [title for title, _ in DOCUMENT_FAMILIES if title not in section] == []


README_LINES = 150
"""README.md's length at most (issue 37: the set-up, what the job prints, a ComfyUI quick start, links)."""
MOVED = (
    ("OPTIONS.md", "Options"), ("OPTIONS.md", "SimpleTuner configs"),
    ("TRAINING.md", "Training: what a run writes, and what it refuses"), ("TRAINING.md", "Noise schedule"),
    ("TRAINING.md", "Refused before any model is built"), ("TRAINING.md", "Previews"), ("TRAINING.md", "Precision"),
    ("TRAINING.md", "Attention kernels"), ("TRAINING.md", "Non-finite values"),
    ("TRAINING.md", "Optimizer, clipping, caption dropout"),
    ("TRAINING.md", "Writes that fail, one run per folder, resumes that check their inputs"),
    ("TRAINING.md", "Recompute that is not deterministic"), ("TRAINING.md", "Damaged files"),
    ("DATA.md", "Data: image folders, captions, buckets"), ("DATA.md", "Buckets"),
    ("MODELS.md", "Model files: single files, quantized files, text encoders"), ("MODELS.md", "Single files"),
    ("MODELS.md", "Quantized files"), ("MODELS.md", "Text encoders"),
    ("LORA_FILES.md", "LoRA files for ComfyUI"), ("LORA_FILES.md", "LoRA variants"),
    ("COMFYUI.md", "In ComfyUI, and the same workflow headless"),
    ("VIDEO.md", "Video LoRAs: clips, frame rules, frame buckets"),
    ("CHECKPOINTING.md", "How the schedule works"), ("CHECKPOINTING.md", "Backends and offload"),
    ("CHECKPOINTING.md", "How to decide (the documents' rule)"),
    ("STREAMING.md", "Weight streaming: the frozen base in host memory, copied in per segment"),
    ("MEASURE.md", "Measure, then choose: sweep and planner"), ("MEASURE.md", "On a GPU"),
    ("GUARDRAILS.md", "Fit guardrails: will it fit, in every phase, and what does it cost"),
    ("MULTI_GPU.md", "Several GPUs: DDP, or FSDP2 when a replica does not fit"),
    ("ARCHITECTURE.md", "Layout"),
)
"""The sections README.md held before issue 37 and the docs/ page (and heading) each moved to."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    """Markdown without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one suffixed ``-1``, ``-2``, ..."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _outside_code(path.read_text()), flags=re.M):
        slug = _slug(heading)
        found.add(next(s for s in (slug, *(f"{slug}-{n}" for n in range(1, 100))) if s not in found))
    return found


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_outside_code(path.read_text())) if not re.match(r"[a-z]+:", t)]


def test_every_relative_markdown_link_resolves():
    broken = []
    for path in _files(".md"):
        for target in _links(path):
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_readme_is_short_and_links_every_moved_section_and_page():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= README_LINES
    links = set(_links(readme))
    missing = [f"docs/{page}: {heading}" for page, heading in MOVED if _slug(heading) not in _anchors(ROOT / "docs" / page)]
    unlinked = [f"docs/{page}#{_slug(heading)}" for page, heading in MOVED if f"docs/{page}#{_slug(heading)}" not in links]
    assert (missing, unlinked) == ([], [])
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert sorted(p for p in pages if not any(link.partition("#")[0] == f"docs/{p}" for link in links)) == []


def test_readme_runs_the_tests_with_the_command_ci_runs():
    """``.ci/run`` runs exactly the test command README.md gives (the last line of both)."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    tests = next(b.strip() for b in blocks if "pytest" in b)
    assert tests.endswith(" && " + ci[-1]) and 'pip install -e ".[test]"' in tests and "torch==2.13.0" in tests


RECIPE_PATH = re.compile(r"(?<![\w/.-])((?:engine|nodes|tests|docs|web|workflows|bench)/[\w/*<>.-]*[\w*>/])")
RECIPES_NAME = {
    "Add a family": {"engine/families/<kind>/<family>.py", "engine/families/comfyui.py", "engine/model/layouts/<module>.py",
                     "engine/model/single_file_formats.py", "engine/model/model_configs/<variant>.json",
                     "docs/FAMILIES.md", "tests/model/test_layouts_image.py"},
    "Add a checkpoint backend": {"engine/config/backends.py", "docs/OPTIONS.md"},
    "Add an option": {"engine/config/", "nodes/*_nodes.py", "tests/config/test_options.py", "docs/OPTIONS.md"},
    "Add a learning-rate schedule": {"engine/config/optim.py", "engine/train/optim.py", "engine/config/train.py",
                                     "tests/train/test_loop.py", "docs/OPTIONS.md"},
}
"""Files each recipe of docs/EXTENDING.md must name (issue 37: a family's adapter, ComfyUI tables,
layout and single-file format; a backend's row (its marks and colours included); an LR
schedule's one declaration and its readers)."""


def test_every_file_an_extending_recipe_names_exists():
    page = (ROOT / "docs" / "EXTENDING.md").read_text()
    recipes = {part.split("\n", 1)[0]: part for part in page.split("\n## ")[1:]}
    named = {title: set(RECIPE_PATH.findall(text)) for title, text in recipes.items()}
    assert {t: sorted(RECIPES_NAME[t] - named.get(t, set())) for t in RECIPES_NAME} == {t: [] for t in RECIPES_NAME}
    missing = [f"{title}: {path}" for title, paths in named.items() for path in sorted(paths)
               if not any(ROOT.glob(re.sub(r"<[^>]*>", "*", path).rstrip("/")))]
    assert missing == []
