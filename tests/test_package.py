"""Packaging: the folder imports as a package under any name, and the engine never needs ComfyUI."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMFY_MODULES = {"comfy", "folder_paths", "server", "nodes", "comfy_extras", "comfy_api", "execution"}


def test_folder_imports_under_any_name_like_comfyui_custom_nodes(tmp_path):
    target = tmp_path / "custom_nodes" / "My-Pack_copy"
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(".git", "output", ".venv", ".ci-venv", "*.egg-info"))
    code = (
        "import importlib.util, sys\n"
        f"path = {str(target / '__init__.py')!r}\n"
        "spec = importlib.util.spec_from_file_location('My-Pack_copy', path, "
        "submodule_search_locations=[str(__import__('pathlib').Path(path).parent)])\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['My-Pack_copy'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(module.WEB_DIRECTORY, hasattr(module, 'NODE_CLASS_MAPPINGS'), hasattr(module, 'comfy_entrypoint'))\n"
        "engine = importlib.import_module('My-Pack_copy.engine.train.loop')\n"
        "print(engine.__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # no node classes without ComfyUI; inside it the V3 entry point alone (a V1 mapping would hide it)
    assert "./web False False" in result.stdout and "My-Pack_copy.engine.train.loop" in result.stdout


def test_engine_imports_without_comfyui():
    code = ("import sys, segmented_checkpointing.engine.train.loop, segmented_checkpointing.cli\n"
            f"bad = {sorted(COMFY_MODULES)!r}\n"
            "print([m for m in bad if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_engine_source_has_no_comfyui_import():
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            assert not set(names) & COMFY_MODULES, f"{path} imports {names}"
