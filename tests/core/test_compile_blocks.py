"""compile_blocks: each block compiled once (inductor on the CPU), the checkpoint call outside it:
losses equal eager over 4 steps on two bucket shapes, nothing recompiles after the first step, and
the blocks that cannot compile stay eager, named."""

from __future__ import annotations

import shutil

import pytest
import torch
from PIL import Image

from segmented_checkpointing.engine.config import LoraSettings, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.compiling import _eager_reason, compile_blocks
from segmented_checkpointing.engine.core.plan import ScheduleWarning, count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.train.loop import train

pytestmark = pytest.mark.heavy  # per-block compile: 20 s with inductor's on-disk cache warm, 70-85 s empty (as on CI)
QUIET = {"log": lambda line: None}
needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="inductor needs a C++ compiler on the CPU (none found: g++ or c++)")


@pytest.fixture(scope="module")
def two_buckets(tmp_path_factory):
    """Two wide images and two square ones: two bucket shapes (64x64, 80x48)."""
    folder = tmp_path_factory.mktemp("compile") / "data"
    folder.mkdir()
    for i, size in enumerate([(96, 56), (96, 56), (64, 64), (64, 64)]):
        Image.new("RGB", size, (40 * i, 120, 200)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a photo {i}")
    return folder


def _config(data, out, schedule, compile_blocks):
    return TrainConfig.create(family="flux", output=str(out), data=str(data), resolution=64, steps=4, buckets=True,
                              lora=LoraSettings(rank=2, alpha=2.0), timing_warmup_steps=1, schedule=schedule,
                              compile_blocks=compile_blocks)


@needs_compiler
@pytest.mark.parametrize("schedule", [CheckpointSchedule(), CheckpointSchedule(
    gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)], ids=["per-block", "interval2-stride4"])
def test_compiled_blocks_train_as_eager_ones_without_recompiling(two_buckets, tmp_path, schedule):
    eager = train(_config(two_buckets, tmp_path / "eager", schedule, False), **QUIET)
    torch._dynamo.reset()  # this run compiles its own graphs (inductor's on-disk cache keeps it quick)
    compiled = train(_config(two_buckets, tmp_path / "compiled", schedule, True), **QUIET)
    shapes = {tuple(b["bucket"] for b in compiled.report["dataset"]["buckets"])}
    assert shapes == {("64x64", "80x48")} or len(next(iter(shapes))) == 2  # two bucket shapes trained
    assert [h["loss"] for h in compiled.history] == pytest.approx([h["loss"] for h in eager.history], abs=1e-5)
    section = compiled.report["compile"]
    family = get_family("flux")
    counts = count_blocks(family, family.model_cls()(**family.tiny_config))
    assert section["compiled_blocks"] == counts and section["eager_blocks"] == {}
    assert section["latent_shapes"] == 2 and section["graphs_after_first_step"] > 0
    assert section["recompiles_after_first_step"] == section["recompiles_after_every_shape"] == 0
    assert compiled.report["totals"]["peak_scope"].startswith("not measured")


def test_blocks_that_cannot_compile_are_named():
    family = get_family("flux")
    model = family.model_cls()(**family.tiny_config)
    for schedule, why in [(CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"), "FFN region"),
                          (CheckpointSchedule(gradient_checkpointing_save_attention=True), "keeps attention outputs"),
                          (CheckpointSchedule(gradient_checkpointing=False, gradient_checkpointing_offload_attention=True),
                           "attention offload")]:
        plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
        runner = SegmentRunner(model, family, plan)
        assert why in _eager_reason(runner, 0, 0, False)
    runner = SegmentRunner(model, family, effective_plan(family, CheckpointSchedule(), count_blocks(family, model),
                                                         warn=False))
    assert _eager_reason(runner, 0, 0, False) is None
    assert "quantized" in _eager_reason(runner, 0, 0, True)
    with pytest.warns(ScheduleWarning, match=r"compile_blocks: blocks left eager: double 0-7 \(its region keeps"):
        plan = effective_plan(family, CheckpointSchedule(gradient_checkpointing_save_attention=True),
                              count_blocks(family, model), warn=False)
        compile_blocks(model, family, SegmentRunner(model, family, plan))
