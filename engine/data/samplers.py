"""The batches of a run: :class:`EpochSampler` (one shape) and :class:`BucketSampler` (batches
that never mix buckets); both resumable from their position.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

from ..config import derived_seed
from .buckets import shape_classes


class EpochSampler:
    """Deterministic shuffled batches: epoch ``e`` uses permutation ``randperm(N, seed + e)``.

    The position ``(epoch, index)`` is all the state there is, so a resumed run continues with
    exactly the batches an uninterrupted run would have drawn.
    """

    def __init__(self, size: int, batch_size: int, seed: int, epoch: int = 0, index: int = 0):
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.epoch, self.index = epoch, index

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(derived_seed(self.seed, self.epoch)))

    def next_batch(self) -> list[int]:
        """Indices of the next batch (crossing into the next epoch when needed)."""
        out = []
        while len(out) < self.batch_size:
            if self.index >= self.size:
                self.epoch, self.index = self.epoch + 1, 0
            out.append(int(self._order()[self.index]))
            self.index += 1
        return out

    def state(self) -> dict[str, int]:
        """``{"epoch": e, "index": i}``."""
        return {"epoch": self.epoch, "index": self.index}


class BucketSampler:
    """Deterministic batches that never mix buckets; the interface of :class:`EpochSampler`.

    Epoch ``e`` draws from one generator seeded ``seed + e``: each bucket's positions are shuffled
    (buckets in the given order) and cut into batches of ``batch_size``, the last one of a bucket
    possibly smaller (kohya keeps it, so every image trains every epoch), then the batches are
    shuffled. The position ``(epoch, index)`` (``index``: batches drawn in the epoch) is all the
    state there is, so a resumed run continues with exactly the batches an uninterrupted run draws.

    Args:
        groups: the epoch positions of each bucket (``StepContext.epoch`` maps a position to its
            cache row).
        batch_size: the most positions per batch.
        seed, epoch, index: the run's seed and the position to continue from.
    """

    def __init__(self, groups: list[list[int]], batch_size: int, seed: int, epoch: int = 0, index: int = 0):
        self.groups, self.batch_size, self.seed = [list(g) for g in groups if g], batch_size, seed
        self.epoch, self.index = epoch, index
        self._plan: tuple[int, list[list[int]]] | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch``, in the order drawn."""
        if self._plan is None or self._plan[0] != epoch:
            generator, batches = torch.Generator().manual_seed(derived_seed(self.seed, epoch)), []
            for group in self.groups:
                shuffled = [group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
                batches += [shuffled[i:i + self.batch_size] for i in range(0, len(shuffled), self.batch_size)]
            order = torch.randperm(len(batches), generator=generator).tolist()
            self._plan = (epoch, [batches[i] for i in order])
        return self._plan[1]

    def next_batch(self) -> list[int]:
        """Positions of the next batch, all of one bucket (the next epoch begins when one ends)."""
        if self.index >= len(self.batches(self.epoch)):
            self.epoch, self.index = self.epoch + 1, 0
        batch = self.batches(self.epoch)[self.index]
        self.index += 1
        return list(batch)

    def state(self) -> dict[str, int]:
        """``{"epoch": e, "index": i}``."""
        return {"epoch": self.epoch, "index": self.index}


def bucket_groups(cache: Mapping[str, torch.Tensor], epoch: list[int]) -> list[list[int]]:
    """The epoch positions of each shape of :func:`shape_classes`, in its order."""
    classes = [set(rows) for _, rows in shape_classes(cache)]
    return [[p for p, row in enumerate(epoch) if row in rows] for rows in classes]


def batch_over_data(cache: Mapping[str, torch.Tensor], epoch: list[int], batch_size: int) -> dict[str, Any] | None:
    """What a batch larger than the data does (``report.json`` ``dataset.batch_over_data``), or
    None when ``batch_size`` is at most the images of an epoch. With one latent shape
    (:class:`EpochSampler`) a batch runs on into the next epochs, so every image appears
    ``batch_size / images`` times in each batch (``repeats_per_step``; a whole number of times or one
    more); with buckets (:class:`BucketSampler`) a batch holds at most one bucket, each image once,
    so batches stay smaller (``largest_batch``).

    Args:
        cache: the run's cache (its latent shapes choose the sampler). epoch: the cache row of each
            position of an epoch (a kohya ``<repeats>_<name>`` folder's images repeated).
        batch_size: the images each step draws (over all processes).
    """
    images = len(epoch)
    if batch_size <= images:
        return None
    one_shape = len(shape_classes(cache)) == 1
    largest = batch_size if one_shape else max(len(group) for group in bucket_groups(cache, epoch))
    return {"batch_size": batch_size, "images_per_epoch": images,
            "repeats_per_step": round(batch_size / images, 3) if one_shape else 1.0, "largest_batch": largest}


def describe_batch_over_data(over: dict[str, Any]) -> str:
    """The log line of :func:`batch_over_data`."""
    head = f"data: batch_size={over['batch_size']} is larger than the {over['images_per_epoch']} images of an epoch"
    if over["repeats_per_step"] == 1.0:
        return (f"{head}: batches never mix buckets, so each holds at most {over['largest_batch']} images, each "
                "once")
    return (f"{head}: each image appears {over['repeats_per_step']:g} times in every batch on average (the same images' "
            "gradients averaged again; fewer images per batch train the same in less time)")


def caption_dropout(seed: int, step: int, micro: int, rows: int, probability: float) -> torch.Tensor:
    """Which of the ``rows`` samples of micro-batch ``micro`` of optimizer step ``step`` (0-based)
    train with the empty caption: ``rand(rows) < probability``, ``(rows,)`` bool.

    The generator is seeded from the run's seed, the step and the micro-batch alone (a hash of
    them), so the draws hold no state: a resumed run draws what an uninterrupted one draws, a step
    retried after an out-of-memory error draws the same, and the noise generator's sequence is not
    touched. Every process of a sharded run draws the global batch's rows alike.
    """
    if probability <= 0:
        return torch.zeros(rows, dtype=torch.bool)
    digest = hashlib.blake2b(f"caption_dropout:{seed}:{step}:{micro}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.rand(rows, generator=generator) < probability
