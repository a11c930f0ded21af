"""What a run's batches do with the data: a batch larger than the data is said, with how many
times each image repeats per step (engine/data/samplers.py ``batch_over_data``; the log line and
``report.json`` of a run: tests/data/test_images.py)."""

from __future__ import annotations

import torch

from segmented_checkpointing.engine.data.samplers import batch_over_data, describe_batch_over_data


def _cache(*shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A cache of one latent shape (``latents``) or of buckets (``bucket_index`` and ``latents.<WxH>``
    per bucket, ``engine/data/buckets.py``); ``shapes``: ``(rows, C, h, w)``, in width order."""
    if len(shapes) == 1:
        return {"latents": torch.zeros(shapes[0])}
    index = [b for b, shape in enumerate(shapes) for _ in range(shape[0])]
    keys = {f"latents.{8 * s[3]}x{8 * s[2]}": torch.zeros(s) for s in shapes}
    return {"bucket_index": torch.tensor(index), **keys}


def test_a_batch_larger_than_the_data_says_how_often_each_image_repeats_per_step():
    assert batch_over_data(_cache((3, 4, 2, 2)), [0, 1, 2], 3) is None
    over = batch_over_data(_cache((3, 4, 2, 2)), [0, 1, 2], 8)
    assert over == {"batch_size": 8, "images_per_epoch": 3, "repeats_per_step": 2.667, "largest_batch": 8}
    assert describe_batch_over_data(over) == (
        "data: batch_size=8 is larger than the 3 images of an epoch: each image appears 2.667 times in every batch on "
        "average (the same images' gradients averaged again; fewer images per batch train the same in less time)")
    repeats = batch_over_data(_cache((2, 4, 2, 2)), [0, 0, 1, 1], 6)  # a kohya 2_name folder: 4 per epoch
    assert repeats["images_per_epoch"] == 4 and repeats["repeats_per_step"] == 1.5


def test_buckets_cap_a_batch_larger_than_the_data_at_the_largest_bucket():
    cache = _cache((2, 4, 3, 2), (3, 4, 2, 3))  # 16x24 (2 images) and 24x16 (3), in the cache's order
    over = batch_over_data(cache, [0, 1, 2, 3, 4], 8)
    assert over == {"batch_size": 8, "images_per_epoch": 5, "repeats_per_step": 1.0, "largest_batch": 3}
    assert describe_batch_over_data(over).endswith("batches never mix buckets, so each holds at most 3 images, each "
                                                   "once")
