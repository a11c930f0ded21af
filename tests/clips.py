"""Small real clips for tests: frames cut from scikit-image's photographs (a pan across the image),
written with PyAV (mp4 / H.264) or Pillow (animated GIF / WebP). A few KB each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def pan_frames(count: int, size: tuple[int, int] = (80, 64), photo: str = "astronaut", step: int = 6) -> list[Image.Image]:
    """``count`` RGB frames of ``size = (width, height)``: a window sliding ``step`` px per frame over a photo."""
    import skimage.data

    array = getattr(skimage.data, photo)()
    if array.ndim == 2:
        array = np.stack([array] * 3, axis=-1)
    image = Image.fromarray(array[..., :3]).convert("RGB").resize((256, 256))
    width, height = size
    return [image.crop((i * step, i * step // 2, i * step + width, i * step // 2 + height)) for i in range(count)]


def write_mp4(path: Path, frames: list[Image.Image], fps: int = 8, options: dict[str, str] | None = None,
              intra: bool = False) -> Path:
    """An H.264 video of ``frames`` (yuv420p; an mp4, or the container of ``path``'s suffix; ``options``:
    the muxer's, ``{"movflags": "faststart"}`` puts an mp4's index first; ``intra``: every frame a
    keyframe, one packet each, in display order)."""
    import av

    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        if intra:
            stream.codec_context.gop_size, stream.codec_context.max_b_frames = 1, 0
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def cut_clip(path: Path, out: Path, packet: int) -> Path:
    """A copy of the video ``path`` cut in the middle of its ``packet``-th video packet (in file
    order), as a copy or download that stopped there."""
    import av

    with av.open(str(path)) as container:
        starts = [(p.pos, p.size) for p in container.demux(container.streams.video[0]) if p.size]
    position, size = starts[packet]
    out.write_bytes(path.read_bytes()[: position + size // 2])
    return out


def write_animated(path: Path, frames: list[Image.Image], fps: int = 8) -> Path:
    """An animated GIF or WebP (by suffix) of ``frames``, ``1000 / fps`` ms each."""
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0,
                   **({"lossless": True} if path.suffix == ".webp" else {}))
    return path


def clip_folder(folder: Path, lengths: tuple[int, ...] = (7, 9, 12), image: bool = True,
                size: tuple[int, int] = (80, 64)) -> Path:
    """A dataset of mp4 clips of ``lengths`` frames (captioned) and, with ``image``, one still photo."""
    folder.mkdir(parents=True, exist_ok=True)
    photos = ("astronaut", "coffee", "chelsea", "rocket")
    for i, count in enumerate(lengths):
        write_mp4(folder / f"clip{i}.mp4", pan_frames(count, size, photos[i % len(photos)]))
        (folder / f"clip{i}.txt").write_text(f"a camera pan over photo {i}")
    if image:
        pan_frames(1, size, "camera")[0].save(folder / "still.png")
        (folder / "still.txt").write_text("a still photo of a cameraman")
    return folder
