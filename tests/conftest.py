"""Test-session settings.

The tests run tiny models whose ops take microseconds: one intra-op thread is faster than two
and, on a loaded 2-core machine, avoids OpenMP threads spinning against each other (measured:
a tiny Flux step took 6-9 s with 2 threads under load, well under 1 s with 1).

The tests live in one folder per engine layer (``tests/core/``, ``tests/train/``, ...) plus
``nodes/``, ``cli/`` and ``live/``; the helpers they share (``helpers.py``, ``original_layouts.py``,
``comfy_models.py``) stay here, importable from every folder.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)
