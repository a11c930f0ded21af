"""``bench/gpu_sweep.py --smoke``: the synthetic sweep runs end to end on CPU and fills every cell."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "torch-ffn", "torch", "unsloth-ffn", "unsloth")
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
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
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
        moves = backend.startswith("unsloth") or (attention and backend in ("none", "torch-ffn"))
        assert (int(cells[5]) > 0) == moves, (row, column, cells[5])
    assert f"wrote {out}" in proc.stdout
