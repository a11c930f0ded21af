"""The frontend's pure JavaScript (web/segckpt_common.js) under node's built-in test runner."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from segmented_checkpointing.engine.config.backends import STREAM_MARKS
from segmented_checkpointing.engine.core.plan import BLOCK_MARKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_js_unit_tests_pass_under_node_test():
    done = subprocess.run(["node", "--test", "tests/js/"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# fail 0" in done.stdout and "# pass 0" not in done.stdout


def test_web_files_are_es_modules_without_dependencies():
    for path in (ROOT / "web").glob("*.js"):
        sources = re.findall(r'^import[^;]*?from\s+"([^"]+)";', path.read_text(), flags=re.M | re.S)
        assert all(s.startswith(("./", "../../scripts/")) for s in sources), (path.name, sources)
        if path.name == "segckpt_common.js":
            assert not sources, "the pure module imports nothing (node --test loads it)"


def test_the_frontend_declares_no_mark_colour_or_label():
    # the strip's colours and labels come with the plan (engine/config/backends.py)
    marks = [*BLOCK_MARKS, *STREAM_MARKS]
    declared = {mark.color.lower() for mark in marks} | {mark.base.lower() for mark in marks if mark.base}
    labels = {f'"{mark.label}"' for mark in marks}
    for path in (ROOT / "web").glob("*.js"):
        text = path.read_text()
        colors = set(re.findall(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b", text))
        assert not {c.lower() for c in colors} & declared, (path.name, sorted(colors))
        assert not [label for label in labels if label in text], path.name
