"""``.safetensors`` files written atomically (``engine/files/atomic.py``): the LoRA, the training
state and the latent cache. Apart from ``atomic.py`` because it imports torch and safetensors,
which the output folder's checks must not (they answer before any heavy import)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .atomic import atomic_write


def atomic_save_file(tensors: Mapping[str, torch.Tensor], path: str | Path,
                     metadata: Mapping[str, str] | None = None) -> Path:
    """Write a ``.safetensors`` file atomically; ``metadata`` goes to its header (str -> str).

    Raises:
        OutputWriteError: the file system refused the write (safetensors reports its own I/O
            errors as ``SafetensorError``); the file named, nothing replaced.
    """
    return atomic_write(path, lambda tmp: save_file(dict(tensors), tmp, metadata=dict(metadata or {})),
                        (OSError, SafetensorError))
