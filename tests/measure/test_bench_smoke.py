"""``bench/gpu_sweep.py --smoke``: the synthetic sweep runs end to end on CPU and fills every cell."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy
ROOT = Path(__file__).resolve().parents[2]
MODES = ("none", "torch-ffn", "torch", "interval2", "interval2-stride4", "unsloth-ffn", "unsloth")
COLUMNS = [name for mode in MODES for name in (mode, f"{mode} +attn-offload")]
NUMBERS = re.compile(r"^\d+\.\d+ / \d+\.\d+$")  # sec/step / peak MiB


def _table(text: str, title: str) -> tuple[list[str], list[list[str]]]:
    """Header and body cells of the markdown table under the heading that starts with ``title``."""
    lines = text[text.index(title):].splitlines()
    end = next((i for i, line in enumerate(lines[2:], 2) if not line.strip()), len(lines))
    rows = [line for line in lines[1:end] if line.startswith("|")]
    split = [[c.strip() for c in line.strip("|").split("|")] for line in rows]
    return split[0], split[2:]


def test_smoke_sweep_fills_every_cell(tmp_path):
    out = tmp_path / "sweep.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_sweep.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()

    header, body = _table(text, "### sec/step / peak MiB")
    assert header == ["row", *COLUMNS]
    assert [row[0].split(" tok")[0] for row in body] == ["64", "128", "96"]  # 2 token rows + the larger stack
    for row in body:
        for column, cell in zip(COLUMNS, row[1:]):
            assert NUMBERS.match(cell), (row[0], column, cell)
            assert all(float(x) > 0 for x in cell.split(" / ")), (row[0], column, cell)

    header, ratios = _table(text, "### Ratio to `torch`")
    torch_column = header.index("torch")
    assert all(row[torch_column] == "1.00x / 1.00x" for row in ratios)

    counters = {(r[0], r[1]): r for r in _table(text, "### Per-cell counters")[1]}
    assert len(counters) == len(body) * len(COLUMNS)
    for (row, column), cells in counters.items():
        backend, attention = column.split(" +")[0], column.endswith("+attn-offload")
        # unsloth* offload boundary inputs; attention offload acts only outside whole-block regions
        # (interval 2 stride 4 leaves blocks 2-3 of every 4 plain)
        moves = backend.startswith("unsloth") or (attention and backend in ("none", "torch-ffn", "interval2-stride4"))
        assert (int(cells[5]) > 0) == moves, (row, column, cells[5])
    for label in {row for row, _ in counters}:
        calls = {c: int(counters[(label, c)][2]) for c in ("torch", "interval2", "interval2-stride4")}
        recomputed = {c: int(counters[(label, c)][3]) for c in calls}
        # depth 4 or 6: per-block calls, half as many pairs, and the stride leaves 2 of every 4 plain
        assert calls["torch"] == 2 * calls["interval2"] == recomputed["torch"] == recomputed["interval2"], label
        assert recomputed["interval2-stride4"] == 2 * calls["interval2-stride4"] < recomputed["interval2"], label
    assert f"wrote {out}" in proc.stdout


ARENA = re.compile(r"(\d+\.\d+) / (\d+\.\d+) \((\d+\.\d+)x, \d+ chunks\)")
"""Part (f)'s arena cell: allocated / used MiB (ratio, chunks)."""


def test_gpu_check_smoke_passes_every_part(tmp_path):
    out = tmp_path / "check.md"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "## (a) Gradient equality, fp32, mid-size Flux: pass" in text
    assert text.count("| ok |") == 25 + 4 + 3  # every checkpointed candidate, the streamed ones, against none
    assert "## (b) The main job: pass" in text and text.count("2 steps, finite") == 3
    streaming = text.split("## (f) Weight streaming")[1].split("## Notes")[0]
    for base in ("bf16", "int8-torchao"):
        assert f"| {base} | resident per-block | layer | " in streaming and "1.00x / 1.00x" in streaming
        assert f"| {base} | stream all, interval 1 | layer-stream | " in streaming
        assert f"| {base} | stream all, interval 2 stride 4 | interval2-stride4-stream | " in streaming
        assert streaming.count(f"| {base} | planner, ") == 3
    arena = [line.split(" | ")[6] for line in streaming.splitlines() if "-stream |" in line]
    assert len(arena) >= 4 and all(ARENA.fullmatch(cell) for cell in arena), arena  # each streamed cell's arena
    multi = _table(text, "## (i) DDP and FSDP2, 2 CPU processes (gloo), tiny Flux: pass")[1]
    assert [row[:2] for row in multi] == [["one process", "1 x 2"], ["DDP", "2 x 1"], ["FSDP2", "2 x 1"]]
    assert all(float(row[4]) <= 1e-4 for row in multi), multi  # every step's loss as one process's
    header, body = _table(text, "sec/step / peak MiB")
    assert [row[0] for row in body] == ["bf16", "int8-torchao", "fp8-torchao"]
    assert header[1:] == ["none", "torch", "interval2", "interval2-stride4", "torch-ffn", "unsloth", "unsloth-ffn",
                          "none +attn-offload", "interval2-stride4 +attn-offload", "torch-ffn +attn-offload",
                          "unsloth-ffn +attn-offload", "diffusers-none", "diffusers-layer"]
    assert all(NUMBERS.match(cell) for row in body for cell in row[1:]), body
    for row in body:  # our per-block schedule keeps what diffusers' own per-block checkpointing keeps
        assert row[header.index("torch")].split(" / ")[1] == row[header.index("diffusers-layer")].split(" / ")[1]
    planner = _table(text, "## (d)")[1]
    assert len(planner) == 3 and all(row[-1] == "yes" for row in planner), planner
    video = text.split("## (g) Video LoRA")[1].split("## Notes")[0]
    assert "| 5 (2) | 56 | " in video and "| 9 (3) | 84 | " in video  # tiny Wan: latent frames x patches
    assert video.count(" / ") >= 10 and "OOM" not in video and "failed" not in video
    assert "all checks pass" in text
