"""Frame-rate arithmetic in exact rational time: the common camera rates, resampled to each other,
give the frames FFmpeg's ``fps`` filter gives; a clip resampled to its own rate as people write it
(29.97) keeps every frame; containers give their rates as exact fractions; preview timestamps do
not drift."""

from __future__ import annotations

import io
import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from clips import pan_frames, write_mp4
from PIL import Image

from segmented_checkpointing.engine.config import DataConfig
from segmented_checkpointing.engine.data.video import ClipInfo, available_frames, frame_indices, probe_clip
from segmented_checkpointing.engine.train.previews import encode_webp

CAMERA = {"23.976": Fraction(24000, 1001), "24": Fraction(24), "25": Fraction(25), "29.97": Fraction(30000, 1001),
          "30": Fraction(30), "50": Fraction(50), "59.94": Fraction(60000, 1001), "60": Fraction(60)}
"""The common camera rates as people write them, and the rates their containers state."""


def ffmpeg_fps(frames: int, rate: Fraction, target: Fraction) -> list[int]:
    """The source frame of each frame FFmpeg's ``fps`` filter (its defaults: ``round=near``,
    ``eof_action=round``) gives from ``frames`` frames at ``rate`` resampled to ``target``
    (each source frame a 2x2 picture whose pixels carry its index)."""
    import av
    from av.filter import Graph

    graph = Graph()
    source = graph.add_buffer(width=2, height=2, format="rgb24", time_base=1 / rate)
    fps = graph.add("fps", f"fps={target.numerator}/{target.denominator}")
    sink = graph.add("buffersink")
    source.link_to(fps)
    fps.link_to(sink)
    graph.configure()
    out = []

    def drain():
        while True:
            try:
                pixel = graph.pull().to_ndarray()[0, 0]
            except (av.error.BlockingIOError, av.error.EOFError):
                return
            out.append(int(pixel[0]) + 256 * int(pixel[1]))

    for i in range(frames):
        frame = av.VideoFrame.from_ndarray(np.full((2, 2, 3), (i % 256, i // 256, 0), np.uint8), format="rgb24")
        frame.pts, frame.time_base, frame.duration = i, 1 / rate, 1
        graph.push(frame)
        drain()
    graph.push(None)
    drain()
    return out


@pytest.mark.parametrize(("source", "target"), list(itertools.product(CAMERA, repeat=2)))
def test_every_camera_rate_resampled_to_every_other_gives_ffmpeg_s_frames(source, target):
    """A 33-frame clip at each camera rate resampled to each (``frame_rate`` as written): the
    count and the source frames FFmpeg's ``fps`` filter gives; at its own rate, every frame."""
    info = ClipInfo(33, CAMERA[source], 16, 16)
    expected = ffmpeg_fps(33, CAMERA[source], CAMERA[target])
    rate = float(target)  # as DataConfig.frame_rate holds it
    assert available_frames(info, rate) == len(expected)
    assert frame_indices(info, len(expected), rate, "first") == expected
    if source == target:
        assert expected == list(range(33))


@pytest.mark.parametrize("written", ["23.976", "29.97", "59.94", "24", "60"])
def test_a_long_clip_at_its_own_written_rate_keeps_every_frame(written):
    """1001 frames (42 s at 23.976) at the container's exact rate, ``frame_rate`` as written: every
    frame, once (a float 29.97 against 30000/1001 used to drop the last); against the neighbouring
    integer rate, FFmpeg's frames."""
    info = ClipInfo(1001, CAMERA[written], 16, 16)
    assert DataConfig(frame_rate=float(written)).rate == CAMERA[written]
    assert frame_indices(info, 1001, float(written), "first") == list(range(1001))
    if "." in written:
        other = round(CAMERA[written])
        expected = ffmpeg_fps(1001, CAMERA[written], Fraction(other))
        assert frame_indices(info, available_frames(info, other), other, "first") == expected
        assert len(expected) == 1002  # 1001 NTSC frames last 1002.001 frames at the integer rate


def test_a_written_rate_is_read_as_the_camera_rate_it_names():
    read = {value: DataConfig(frame_rate=value).rate for value in (23.976, 23.98, 29.97, 59.94, 47.952, 119.88,
                                                                  24.0, 12.5, 23.5, 1.0)}
    assert read == {23.976: Fraction(24000, 1001), 23.98: Fraction(24000, 1001), 29.97: Fraction(30000, 1001),
                    59.94: Fraction(60000, 1001), 47.952: Fraction(48000, 1001), 119.88: Fraction(120000, 1001),
                    24.0: 24, 12.5: Fraction(25, 2), 23.5: Fraction(47, 2), 1.0: 1}
    assert DataConfig().rate is None


def test_a_clip_s_rate_is_its_container_s_exact_fraction(tmp_path):
    """Each camera rate written into an mp4 (3 frames, 16x16) probes to the exact rate it was written at."""
    frames = pan_frames(3, (16, 16))
    rates = {name: probe_clip(write_mp4(tmp_path / f"{i}.mp4", frames, fps=rate)).fps
             for i, (name, rate) in enumerate(CAMERA.items())}
    assert rates == CAMERA and all(isinstance(rate, Fraction) for rate in rates.values())


def test_a_preview_s_frames_start_at_their_exact_times_to_the_millisecond():
    """A 5-frame preview at 23.976 fps: frame k starts at k x 1001/24 ms rounded (0, 42, 83, 125,
    167; it ends at 209), not 42 ms per frame (210: a frame of drift every 6 s)."""
    with Image.open(io.BytesIO(encode_webp(torch.rand(3, 5, 8, 8), fps=23.976))) as image:
        durations = []
        for k in range(image.n_frames):
            image.seek(k)
            image.load()
            durations.append(image.info["duration"])
    assert durations == [42, 41, 42, 42, 42]
