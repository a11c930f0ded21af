"""Host memory from a few large chunks: the streamed weights' host copies and the activation offload
pool's buffers are views into them (docs/STREAMING.md "Host memory").

Why: CUDA's caching host allocator rounds every pinned block up to a power of two, so pinning one
tensor at a time can cost 50-100% more host memory than the tensors hold (issue 36; DiffSynth-Studio
measured this and bump-allocates from large pinned chunks). Here each chunk is requested at a power
of two, so the allocator rounds nothing; tensors sit in it at :data:`ALIGN`-byte offsets.

:func:`plan_chunks` chooses the chunk sizes from the bytes to be placed, known before anything is
allocated (the streamer's weights; the host budget's estimate uses the same function, so the budget
counts what will be allocated). :class:`HostArena` places tensors first-fit into those chunks,
allocating each chunk when it is first used, and grows by doubling when asked for more than was
planned (the activation pool, whose sizes are not known ahead). The chunks come from a function the
caller gives (:class:`~.offload.HostPool`: pinned where CUDA allows, plain CPU memory otherwise),
so the placement code is the same pinned or not.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

ALIGN = 256
"""Byte alignment of a tensor inside a chunk (CUDA's allocator alignment)."""

MAX_CHUNKS = 4
"""A plan aims at this many chunks (fewer host allocations) unless they would exceed :data:`CHUNK_CAP`."""

CHUNK_CAP = 1 << 30
"""Largest planned chunk (1 GiB): larger streamed sets take more chunks, so the power-of-two rounding of
the last one stays under 1 GiB (a Flux.1-dev base, 22 GiB, takes 22 or 23 chunks)."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def pow2(nbytes: int) -> int:
    """The smallest power of two >= ``nbytes`` (1 for 0)."""
    return 1 << max(nbytes - 1, 0).bit_length()


def chunk_bytes(total: int, largest: int = 0) -> int:
    """The planned chunk size for ``total`` bytes whose largest tensor has ``largest`` (aligned) bytes:
    the power of two that splits ``total`` into at most :data:`MAX_CHUNKS` chunks, at most
    :data:`CHUNK_CAP`, and never smaller than the largest tensor."""
    return max(pow2(largest), min(pow2(-(-max(total, 1) // MAX_CHUNKS)), CHUNK_CAP))


def _first_fit(used: list[int], caps: list[int], need: int) -> int | None:
    for k, (u, cap) in enumerate(zip(used, caps)):
        if u + need <= cap:
            return k
    return None


def plan_chunks(sizes: Sequence[int]) -> list[int]:
    """Chunk sizes (bytes, each a power of two) that hold tensors of ``sizes`` bytes placed in this order
    by :meth:`HostArena.take`: full chunks of :func:`chunk_bytes`, the last one shrunk to the power of
    two its tensors need. Its rounding is the only slack besides alignment and the chunks' ends.

    Args:
        sizes: bytes of each tensor, in the order they will be taken.

    Returns:
        The chunk sizes in bytes ([] for no bytes).
    """
    needs = [aligned(s) for s in sizes]
    if not any(needs):
        return []
    size = chunk_bytes(sum(needs), max(needs))
    used: list[int] = []
    for need in needs:
        k = _first_fit(used, [size] * len(used), need)
        if k is None:
            used.append(0)
            k = len(used) - 1
        used[k] += need
    return [size] * (len(used) - 1) + [pow2(used[-1])]


def planned_total(total: int) -> int:
    """The chunk bytes :func:`plan_chunks` allocates for ``total`` bytes when only the total is known
    (the planner's per-block sums): full chunks of :func:`chunk_bytes` and the rest rounded up to a
    power of two; alignment and the chunks' ends (a few percent for small tensors) not counted."""
    if total <= 0:
        return 0
    full, rest = divmod(total, chunk_bytes(total))
    return full * chunk_bytes(total) + (pow2(rest) if rest else 0)


class HostArena:
    """Host tensors as views into a few large chunks, placed first-fit at :data:`ALIGN`-byte offsets.

    Args:
        allocate: ``allocate(nbytes)`` -> a 1-D ``uint8`` host tensor of ``nbytes`` (a chunk).
        planned: chunk sizes from :func:`plan_chunks` (allocated on first use); when they are
            full, or with none, a new chunk is the larger of the request's power of two and the power
            of two of the bytes allocated so far (doubling), at most :data:`CHUNK_CAP` unless the request is larger.

    Attributes:
        chunks: the chunks allocated so far. allocated_bytes: their bytes. used_bytes: the bytes of
        the tensors taken (unaligned).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], planned: Sequence[int] = ()):
        self._allocate = allocate
        self._caps: list[int] = list(planned)
        self._used: list[int] = [0] * len(self._caps)
        self.chunks: list[torch.Tensor | None] = [None] * len(self._caps)
        self.used_bytes = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the chunks allocated so far."""
        return sum(c.numel() for c in self.chunks if c is not None)

    @property
    def chunk_count(self) -> int:
        """Chunks allocated so far."""
        return sum(c is not None for c in self.chunks)

    @property
    def rounding_bytes(self) -> int:
        """Bytes of the allocated chunks that no tensor uses (alignment, chunk ends, rounding)."""
        return self.allocated_bytes - self.used_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` view of ``nbytes`` bytes in a chunk, at an :data:`ALIGN`-byte offset.

        Args:
            nbytes: bytes wanted (0 gives an empty view).
        """
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)  # nothing to place (no 1-byte chunk for it)
        need = aligned(nbytes)
        k = _first_fit(self._used, self._caps, need)
        if k is None:
            grown = max(pow2(need), pow2(min(self.allocated_bytes, CHUNK_CAP)))
            self._caps.append(grown)
            self._used.append(0)
            self.chunks.append(None)
            k = len(self._caps) - 1
        if self.chunks[k] is None:
            self.chunks[k] = self._allocate(self._caps[k])
        offset = self._used[k]
        self._used[k] += need
        self.used_bytes += nbytes
        return self.chunks[k][offset: offset + nbytes]

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view into one of the chunks."""
        ptr = tensor.untyped_storage().data_ptr()
        return any(c is not None and c.untyped_storage().data_ptr() == ptr for c in self.chunks)
