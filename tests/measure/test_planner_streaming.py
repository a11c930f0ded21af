"""The planner plans device and host memory together: a device budget below the frozen weights
streams the fewest blocks that fit, and a host budget below the streamed bytes is refused before
any model is built."""

from __future__ import annotations

import pytest
from helpers import refuse_to_build_models

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.measure.costs import BlockCost
from segmented_checkpointing.engine.measure.host import HostBudgetError, host_budget_bytes
from segmented_checkpointing.engine.measure.planner import PlannerError, choose
from segmented_checkpointing.engine.measure.probe import Probe, probe
from segmented_checkpointing.engine.measure.runs import RunWorkspace, peak_after_warmup
from segmented_checkpointing.engine.model.bundle import build_preset

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_a_budget_below_the_frozen_weights_streams_and_the_run_fits(tmp_path):
    config = TrainConfig.create(family="flux", resolution=64, batch_size=2, output=str(tmp_path / "plan"))
    bundle = build_preset("flux")
    with RunWorkspace(config, bundle) as workspace:
        measured = probe(workspace)
        frozen = sum(sum(per_block) for per_block in measured.frozen_block_bytes.values())
        budget = int(0.97 * frozen)  # below the blocks' frozen weights alone: no resident schedule can fit
        choice = choose(measured, budget, stream=True)  # asked for: on the CPU it saves nothing
        chosen = choice.chosen
        assert chosen.schedule.streams and chosen.streamed_bytes > 0.2 * frozen
        assert all(not p.fits for p in choice.candidates if not p.schedule.streams)
        assert "host " in choice.render() and "weights streamed:" in choice.render()
        real = peak_after_warmup(workspace.run(chosen.schedule, 1, 1), 1)
        assert real <= budget, (chosen.schedule.mode, real, budget)
        # the host copies count against a host budget: below them, only schedules that stream less fit
        with pytest.raises(PlannerError, match=r"--host-budget=.* is too small: the schedules that fit the device "
                                               r"need at least"):
            choose(measured, budget, host_budget_bytes=int(0.1 * frozen), stream=True)


def _probe(device):
    """A probe of 2 + 2 flux blocks, each with 1000 bytes of activations and 4000 of frozen weights."""
    blocks = {name: [BlockCost(name, i, act=1000, carried=100, fwd_s=0.01) for i in range(2)]
              for name in ("double", "single")}
    return Probe("flux", device, blocks, peak_bytes=30_000, sec_per_step=0.1, offload_s_per_tensor=0.0,
                 offload_s_per_byte=0.0, frozen_block_bytes={"double": [4000] * 2, "single": [4000] * 2},
                 h2d_s_per_byte=1e-9, held_bytes=20_000)


def test_on_the_cpu_the_planner_streams_only_when_asked():
    """Where the device is the host, streaming saves no memory: a budget below the weights is
    refused with that said, unless the user asked for weight_offload=stream (issue 34)."""
    budget = 20_000  # below the held weights: nothing fits resident
    with pytest.raises(PlannerError, match=r"weight streaming was not tried: on the CPU the device is host memory"):
        choose(_probe("cpu"), budget)
    assert choose(_probe("cpu"), budget, stream=True).chosen.schedule.streams
    assert choose(_probe("cuda"), budget).chosen.schedule.streams  # a CUDA device: the planner's own answer
    assert not choose(_probe("cpu"), 10**6).chosen.schedule.streams  # what fits resident never streams


def test_a_host_budget_below_the_streamed_bytes_is_refused_before_any_model_is_built(monkeypatch, capsys, tmp_path):
    refuse_to_build_models(monkeypatch, "the host budget was checked")
    status = cli.main(["plan", "--family", "flux", "--weight-offload", "stream", "--host-budget", "0.0001",
                       "--budget", "1", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "host_budget=0.0001 is too small: weight_offload=stream (interval2-stride4-stream) keeps" in err
    assert "bytes" in err and "of frozen weights in host memory" in err


def test_host_budget_values():
    assert host_budget_bytes("2") == 2 * 2**30 and host_budget_bytes("free") > 0 and host_budget_bytes() > 0
    with pytest.raises(HostBudgetError, match=r"host_budget='lots' is invalid: allowed a number of GiB"):
        host_budget_bytes("lots")


def test_a_plain_step_that_does_not_fit_is_probed_on_a_shallow_copy(tmp_path):
    """The probe works where the no-checkpoint step runs out of memory: it measures a copy with
    two blocks per list and extrapolates; its predictions match the full probe's."""
    import torch

    from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
    from segmented_checkpointing.engine.measure.planner import predict
    from segmented_checkpointing.engine.train.loop import TrainingRun

    class SmallDevice(TrainingRun):  # the plain step of the whole model does not fit
        def __iter__(self):
            blocks = sum(len(self.bundle.family.blocks(self.bundle.transformer, bl))
                         for bl in self.bundle.family.block_lists)
            if not self.config.schedule.gradient_checkpointing and blocks > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            yield from super().__iter__()

    # Prodigy keeps four states per LoRA parameter: the blocks left out add theirs, as measured
    config = TrainConfig.create(family="flux", resolution=64, batch_size=2, output=str(tmp_path / "plan"),
                                optimizer="prodigy", learning_rate=1.0)
    bundle = build_preset("flux")
    with RunWorkspace(config, bundle) as workspace:
        full = probe(workspace)
    with RunWorkspace(config, bundle, SmallDevice) as workspace:
        shallow = probe(workspace)
    assert shallow.extrapolated_from == 2 and full.extrapolated_from == 0
    assert {k: len(v) for k, v in shallow.blocks.items()} == {"double": 8, "single": 8}
    assert shallow.frozen_block_bytes == full.frozen_block_bytes
    assert shallow.optimizer_block_bytes == full.optimizer_block_bytes
    assert shallow.held_bytes == full.held_bytes
    for schedule in (CheckpointSchedule(gradient_checkpointing=False), CheckpointSchedule(),
                     CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4),
                     CheckpointSchedule(weight_offload="stream")):
        guess, real = predict(shallow, schedule).peak_bytes, predict(full, schedule).peak_bytes
        assert abs(guess - real) <= 0.05 * real, (schedule.mode, guess, real)
    assert "measured a copy with 2 blocks per list" in choose(shallow, full.peak_bytes * 2).render()


def test_free_host_memory_is_the_kernels_available_figure(tmp_path):
    from segmented_checkpointing.engine.core.memory import host_available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          700000 kB\nMemAvailable:   17000000 kB\n")
    assert host_available_bytes(meminfo) == 17000000 * 1024
    assert host_available_bytes(tmp_path / "missing") > 0  # the free pages, where the file does not exist
