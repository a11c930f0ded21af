"""Which scaled-dot-product-attention kernels a training step may use (``attention_backend``).

On CUDA, torch picks the SDPA kernel per call from the enabled backends; on H100/H200 recent
torch tries cuDNN's fused attention first, and its backward returns NaN or faults for some shapes
our models produce (measured on an H200 with torch 2.11; pytorch/pytorch#196678 and
huggingface/trl#7181 report the same class of fault). ``auto`` therefore enables flash,
memory-efficient and math attention and leaves cuDNN out for training.

The trainer enters :func:`sdpa_context` around forward *and* backward, so that every recompute
of a checkpointed region (which runs inside backward) sees exactly the forward's choice. torch
keeps these switches process-wide (not per thread): that is also what makes CUDA's autograd
thread see them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config.model import AttentionBackendError, parse_attention_backend

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
CPU_KERNELS = ("flash", "math")  # torch's CPU SDPA implements these two


def check_attention_backend(value: Any, device: torch.device) -> tuple[str, ...]:
    """:func:`parse_attention_backend`, plus: the list must hold a kernel ``device`` has.

    Raises:
        AttentionBackendError: as above, or only CUDA kernels for a CPU run.
    """
    names = parse_attention_backend(value)
    if device.type == "cpu" and not set(names) & set(CPU_KERNELS):
        raise AttentionBackendError(f"attention_backend={value!r} is invalid on the CPU: allowed a list "
                                    f"holding {' or '.join(CPU_KERNELS)} (the CPU has no other SDPA kernel).")
    return names


def sdpa_context(names: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """Enable exactly ``names`` (in that priority order) for the ``with`` block, then restore."""
    return sdpa_kernel([KERNELS[n] for n in names], set_priority=True)


def enabled_kernels() -> tuple[str, ...]:
    """The SDPA kernels enabled right now (read from torch's switches)."""
    flags = {"flash": torch.backends.cuda.flash_sdp_enabled(),
             "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
             "math": torch.backends.cuda.math_sdp_enabled(),
             "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    return tuple(n for n in KERNELS if flags[n])
