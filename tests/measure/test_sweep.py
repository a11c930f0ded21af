"""Checkpointing sweep: cell statuses (OOM, failed, unsupported, not run), flags, and the outputs."""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import warnings
import weakref

import pytest
import torch
from PIL import Image

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import LoraSettings, MeasureConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import effective_plan
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.measure.runs import Progress, RunWorkspace
from segmented_checkpointing.engine.measure.sweep import (
    SweepCell,
    flag_ineffective,
    run_sweep,
    sweep_schedules,
    to_markdown,
    write_outputs,
)
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import TrainingRun

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _config(tmp_path, family="ideogram4"):
    return TrainConfig.create(family=family, resolution=32, output=str(tmp_path / "unused"), lora=LoraSettings(rank=4, alpha=4.0))


def test_oom_failed_unsupported_and_not_run_cells_do_not_stop_the_sweep(tmp_path):
    bundle = build_preset("ideogram4")  # no FFN and no attention boundary: those modes are unsupported
    schedules = [CheckpointSchedule(gradient_checkpointing=False), CheckpointSchedule(),
                 CheckpointSchedule(gradient_checkpointing_interval=2),
                 CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"),
                 CheckpointSchedule(gradient_checkpointing_offload_attention=True),
                 CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)]
    calls = []

    class Faulty(TrainingRun):
        def __iter__(self):
            calls.append(self.config.schedule.mode)
            if self.config.schedule.mode == "layer":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            if self.config.schedule.mode == "interval2":
                raise RuntimeError("block 3 exploded")
            return super().__iter__()

    before = {k: v.clone() for k, v in bundle.transformer.state_dict().items()}
    cells = run_sweep(RunWorkspace(_config(tmp_path), bundle, Faulty), MeasureConfig.create(measured_steps=1),
                      Progress(log=lambda line: None), schedules=schedules,
                      skip=lambda s: s.gradient_checkpointing_segment_stride == 4)
    status = {c.mode: c.status for c in cells}
    assert status == {"none": "ok", "layer": "OOM", "interval2": "failed", "layer-torch-ffn": "unsupported",
                      "layer-offload-attn": "unsupported", "interval2-stride4": "not run"}
    assert calls == ["none", "layer", "interval2"]  # the sweep went on after the OOM and the failure
    by_mode = {c.mode: c for c in cells}
    assert "out of memory" in by_mode["layer"].error and "block 3 exploded" in by_mode["interval2"].error
    assert "no FFN boundary" in by_mode["layer-torch-ffn"].error
    none = by_mode["none"]
    assert none.sec_per_step > 0 and none.peak_bytes > 0 and none.text() == (
        f"{none.sec_per_step:.3f} / {none.peak_bytes / 2**30:.4g}")
    after = bundle.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # every cell trained a copy
    table = to_markdown(cells, "ideogram4")
    for text in ("| layer | torch | no | OOM |", "| interval2 | torch | no | failed |", "unsupported", "not run"):
        assert text in table


def test_the_no_effect_note_comes_from_equal_plans_never_from_numbers():
    """Every mode measures within noise of the others (tiny sizes); only the modes whose per-block
    plans equal an earlier mode's are flagged, naming it (issue 34)."""
    schedules = [CheckpointSchedule(gradient_checkpointing=False), CheckpointSchedule(),
                 CheckpointSchedule(gradient_checkpointing_offload_attention=True),
                 CheckpointSchedule(gradient_checkpointing_interval=2),
                 CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4),
                 CheckpointSchedule(gradient_checkpointing_backend="torch-ffn"),
                 CheckpointSchedule(gradient_checkpointing_backend="torch-ffn", gradient_checkpointing_interval=2),
                 CheckpointSchedule(gradient_checkpointing_backend="torch-ffn", gradient_checkpointing_offload_attention=True)]
    counts = {"double": 2, "single": 2}  # 2 blocks per list: a stride of 4 leaves no block plain
    cells = [SweepCell(s.mode, s.to_dict(), "ok", 1.0 + i / 1000, 1000) for i, s in enumerate(schedules)]
    cells.append(SweepCell("interval2-offload-attn", {}, "OOM"))  # not measured: its plan still counts
    plans = [(effective_plan(get_family("flux"), s, counts, warn=False).effect(), ()) for s in schedules]
    plans.append((effective_plan(get_family("flux"), schedules[3].replace(gradient_checkpointing_offload_attention=True),
                                 counts, warn=False).effect(), ()))
    flag_ineffective(cells, plans)
    flagged = {c.mode: c.flags for c in cells if c.flags}
    assert flagged == {
        # inside whole-block regions no attention activation is kept: nothing to offload
        "layer-offload-attn": ["option may not have taken effect (same per-block plan as layer)"],
        "interval2-stride4": ["option may not have taken effect (same per-block plan as interval2, "
                              "interval2-offload-attn)"],
        "interval2-offload-attn": ["option may not have taken effect (same per-block plan as interval2, "
                                   "interval2-stride4)"],
        # an FFN-scope backend checkpoints each block's FFN on its own: the interval changes nothing
        "interval2-torch-ffn": ["option may not have taken effect (same per-block plan as layer-torch-ffn)"]}
    far = [dataclasses.replace(c, sec_per_step=10.0 * (i + 1), peak_bytes=1000 * (i + 1), flags=[])
           for i, c in enumerate(cells)]
    flag_ineffective(far, plans)
    assert {c.mode: c.flags for c in far if c.flags} == flagged  # the numbers play no part
    compiled = [dataclasses.replace(cells[1], mode="layer+compile", flags=[])]
    flag_ineffective(cells[:2] + compiled, plans[:2] + [(plans[1][0], (("compile_blocks", True),))])
    assert compiled[0].flags == []  # compile_blocks is a setting of its own


def test_plan_notes_are_said_once_under_the_sweep_table():
    from segmented_checkpointing.engine.core.plan import HOST_STREAMING_NOTE

    cells = [SweepCell(mode, {"gradient_checkpointing_backend": "torch", "gradient_checkpointing_offload_attention": False,
                              "weight_offload": "stream"}, "ok", 1.0, 1000, notes=[HOST_STREAMING_NOTE])
             for mode in ("none-stream", "layer-stream")]
    table = to_markdown(cells, "flux")
    assert table.count(HOST_STREAMING_NOTE) == 1
    assert table.endswith(f"Plan notes:\n- {HOST_STREAMING_NOTE} (none-stream, layer-stream)\n")


def test_sweep_modes_cover_the_documents_schedules():
    modes = [s.mode for s in sweep_schedules()]
    assert modes[:2] == ["none", "none-offload-attn"] and len(modes) == 2 + 3 * 4 * 2
    assert {"layer", "interval2", "interval2-stride4", "interval2-stride4-unsloth-ffn-offload-attn"} <= set(modes)


def test_segckpt_sweep_writes_markdown_csv_json_and_a_png_with_one_point_per_measured_mode(tmp_path, capsys,
                                                                                            monkeypatch):
    from segmented_checkpointing.engine.core import offload

    out = tmp_path / "sweep"
    monkeypatch.setattr(offload, "_SAID", set(), raising=False)  # as in a fresh process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        assert cli.main(["sweep", "--resolution", "32", "--warmup", "1", "--measure", "1", "--no-attention-offload",
                         "--rank", "4", "--budget-gib", "0.001", "--output", str(out)]) == 0
    # six modes offload to host memory, each with a pool of its own: said once (issue 34)
    assert sum(issubclass(w.category, offload.PinnedMemoryWarning) for w in caught) == 1
    printed = capsys.readouterr().out
    assert "| interval2-stride4 | torch | no |" in printed
    # an FFN-scope backend checkpoints each block's FFN alone: interval 2 runs the plan of interval 1
    assert "| interval2-torch-ffn | torch-ffn | no |" in printed and printed.count("option may not have taken") == 2
    assert "option may not have taken effect (same per-block plan as layer-unsloth-ffn) |" in printed
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    data = json.loads((out / "sweep.json").read_text())
    assert len(rows) == len(data["cells"]) == 1 + 3 * 4 and data["family"] == "flux"
    measured = [r for r in rows if r["status"] == "ok"]
    assert len(measured) == len(rows)  # every mode is wired for flux
    assert all(float(r["sec_per_step"]) > 0 and int(r["peak_bytes"]) > 0 for r in measured)
    image = Image.open(out / "sweep.png")
    assert image.format == "PNG" and image.size[0] > 400
    assert image.text["segckpt:points"] == str(len(measured))
    assert (out / "sweep.md").read_text().startswith("# Checkpointing sweep: flux")


def test_the_sweep_plot_labels_never_overlap():
    """36 modes measured within noise of each other (tiny sizes) and one far off: every label is drawn,
    inside the figure, and no two labels' boxes meet (issue 34)."""
    from matplotlib.text import Text

    from segmented_checkpointing.engine.measure.plots import sweep_figure

    modes = [s.mode for s in sweep_schedules(save_attention=True, streaming=True)]
    cells = [SweepCell(m, {}, "ok", 0.05 + i * 1e-4, 10 * 2**20 + i * 1000) for i, m in enumerate(modes)]
    cells[5] = dataclasses.replace(cells[5], sec_per_step=0.2, peak_bytes=2**29)
    figure = sweep_figure(cells + [SweepCell("layer+compile", {}, "failed")], "flux", budget_bytes=2**28)
    renderer = figure.canvas.get_renderer()
    figure.canvas.draw()
    labels = figure.axes[0].texts
    assert [t.get_text() for t in labels] == modes
    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text, not its leader line
    page = figure.bbox
    for i, box in enumerate(boxes):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, modes[i]
        assert not [modes[k] for k, other in enumerate(boxes) if k != i and box.overlaps(other)], modes[i]


def test_write_outputs_of_failed_sweep_still_plots(tmp_path):
    cells = [SweepCell("none", {"gradient_checkpointing_backend": "torch",
                                "gradient_checkpointing_offload_attention": False}, "failed", error="boom")]
    paths = write_outputs(cells, tmp_path, "flux", budget_bytes=2**30)
    assert Image.open(paths["png"]).text["segckpt:points"] == "0"


@pytest.mark.parametrize("args, text", [(["--budget-gib", "-2"], "budget_gib=-2.0 is invalid: allowed a number of GiB "
                                                                "from 0 to 4096 (0: none)"),
                                        (["--measure", "0"], "measured_steps=0 is invalid: allowed an integer from 1"),
                                        (["--warmup", "0"], "warmup_steps=0 is invalid: allowed an integer from 1")])
def test_segckpt_sweep_refuses_bad_options_before_any_work(tmp_path, capsys, args, text):
    assert cli.main(["sweep", *args, "--output", str(tmp_path / "never")]) == 2
    assert text in capsys.readouterr().err and not (tmp_path / "never").exists()


def test_progress_after_every_step_and_cancel_within_one_step(tmp_path):
    from segmented_checkpointing.engine.measure.runs import MeasurementInterrupted

    bundle, steps = build_preset("flux"), []
    schedules = [CheckpointSchedule(gradient_checkpointing=False), CheckpointSchedule()]
    with pytest.raises(MeasurementInterrupted):
        run_sweep(RunWorkspace(_config(tmp_path), bundle, on_step=lambda done, total: steps.append((done, total)),
                               should_stop=lambda: len(steps) >= 4),
                  MeasureConfig.create(measured_steps=2), Progress(log=lambda line: None), schedules=schedules)
    # 3 steps of the first mode, then the first step of the second: stopped there; of 2 x 3 in all
    assert steps == [(1, 6), (2, 6), (3, 6), (4, 6)]


def test_ctrl_c_during_a_sweep_keeps_the_cells_measured_so_far(tmp_path, monkeypatch, capsys):
    """The tables are written after every cell: an interrupted sweep leaves them with the rest
    marked not run, and ends in one line (exit 130), no traceback."""
    from segmented_checkpointing.engine.measure import sweep as sweep_module

    measure, calls = sweep_module._measure, []

    def interrupted(cell, *args):
        calls.append(cell.mode)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(cell, *args)

    monkeypatch.setattr(sweep_module, "_measure", interrupted)
    status = cli.main(["sweep", "--resolution", "64", "--no-attention-offload", "--warmup", "1", "--measure", "1",
                       "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("segckpt: interrupted: 2 of 13 modes measured;")
    table = (tmp_path / "sweep.md").read_text()
    assert table.count("| not run |") == 11 and f"| {calls[0]} |" in table
    cells = json.loads((tmp_path / "sweep.json").read_text())["cells"]
    assert [c["status"] for c in cells[:2]] == ["ok", "ok"] and len(cells) == 13
    assert Image.open(tmp_path / "sweep.png").size[0] > 0  # the plot, written when the sweep stopped


def test_a_finished_measurement_run_frees_its_model_copy_without_the_cyclic_collector(tmp_path):
    """Each measurement run trains a deep copy of the model; once its result is dropped the copy
    goes at once (with the collector off), so the next run's device peak and the host's memory
    hold one model copy, not every earlier one (a streamed full-size Flux.1-dev on an H200 was killed,
    by all signs out of host memory, at its fourth run). A sweep runs the collector only after a
    failed cell or on CUDA (``sweep._free_memory``): every backend, streaming and saved attention here."""
    config = TrainConfig.create(family="flux", resolution=32, output=str(tmp_path))
    with RunWorkspace(config, build_preset("flux")) as workspace:
        for schedule in (CheckpointSchedule(), CheckpointSchedule(weight_offload="stream"),
                         CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4,
                                            gradient_checkpointing_backend="unsloth",
                                            gradient_checkpointing_offload_attention=True),
                         CheckpointSchedule(gradient_checkpointing_save_attention=True)):
            gc.collect()
            gc.disable()
            try:
                result = workspace.run(schedule, 1, 1)
                model = weakref.ref(result.model)
                del result
                assert model() is None, schedule.mode
            finally:
                gc.enable()
