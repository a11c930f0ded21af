"""Sharded training (FSDP2 under torchrun, 2 CPU processes, gloo) equals the single-process run.

Two families (Flux: two block lists; SD3: one), four schedules (none, layer, interval 2 with the
unsloth offload backend, interval 2 stride 4),
3 steps, every one's gradients clipped: per-step losses, gradient norms and the LoRA rank 0 saves equal
the single-process run's within 1e-5 (the
sharded runs train batch_size 1 per process, the single-process runs the same global batch of 2); a
sharded run resumed after step 2 (its batch given as global_batch_size 2) continues exactly
(bit-equal to the uninterrupted sharded run);
``segckpt train --fsdp --fsdp-activation-checkpointing`` with a model-level schedule warns once
and reports only the FSDP-style plan. The option checks run without a process group.

DDP in the same torchrun job (Flux): per-block, interval 2 stride 4, unsloth, and streamed weights with
2 accumulated micro-batches (``no_sync`` on the first), 1 per process, equal the single-process runs at
batch 2 (losses and LoRA within 1e-6); a 1-process state continues on 2 DDP processes, and that state
continues in one process, each equal to the uninterrupted single-process run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, DataConfig, TrainConfig
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import FSDP_WRAPPER, ScheduleWarning, effective_plan
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.model.distributed import ENV_KEYS, Distributed, DistributedError, check_launch
from segmented_checkpointing.engine.train.checks import check_global_batch, processes, saved_global_batch
from segmented_checkpointing.engine.train.loop import TrainingRun, train

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built"),
              pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.model.text_encoders.TextEncoderWarning")]

WORKER = Path(__file__).with_name("fsdp_worker.py")
COMMON = {"resolution": 64, "batch_size": 2, "steps": 3, "timing_warmup_steps": 0, "watchdog_slowdown": 0,
          "seed": 3, "max_grad_norm": 0.02, "learning_rate": 1e-4}
"""max_grad_norm: every step's gradients are clipped (the tiny models' norms are larger; the test checks it).
learning_rate: the batch split's summation order changes gradients by float rounding, and AdamW turns that into
a change of the update's direction where a gradient element is near 0; the LoRA then differs by about 3e-3 of
the learning rate (3.2e-6 at the default 1e-3, FSDP and DDP alike; the losses are equal)."""
SCHEDULES = {
    "none": {"gradient_checkpointing": False},
    "layer": {"gradient_checkpointing_interval": 1},
    "interval2-unsloth": {"gradient_checkpointing_interval": 2, "gradient_checkpointing_backend": "unsloth"},
    "interval2-stride4": {"gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4},
}
FAMILIES = ("flux", "sd3")
DDP_RUNS = {name: SCHEDULES[name] for name in ("layer", "interval2-stride4", "interval2-unsloth")} | {
    "stream": {"gradient_checkpointing_interval": 1, "weight_offload": "stream", "gradient_accumulation_steps": 2}}
"""DDP's runs (Flux); each equals the single-process run ``one-<name>`` (``stream``: the same keys, weights resident)."""
ONE_ONLY = {"stream": {"gradient_checkpointing_interval": 1, "gradient_accumulation_steps": 2}}
"""The single-process references that only DDP's runs need (Flux)."""


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGS`` (a free rendezvous port of its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
    for key in ENV_KEYS:
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _losses(folder: Path) -> list[float]:
    return [step["loss"] for step in json.loads((folder / "report.json").read_text())["steps"]]


def _lora(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "lora.safetensors"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session sees: the first worker that needs the
    torchrun job (or a single-process run) makes it under :func:`_lock`, the others read it
    (pytest-xdist's recipe for a fixture that runs once per session)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "distributed"
    folder.mkdir(exist_ok=True)
    return folder


def _lock(shared: Path) -> FileLock:
    return FileLock(str(shared) + ".lock")


@pytest.fixture(scope="module")
def sharded(shared) -> dict[str, Path]:
    """One torchrun job for every family (every schedule, then a 2-step run and its resume to 3,
    in order): ``{family: its folder}`` (one process group: its start-up is paid once per session)."""
    roots = {family: shared / f"fsdp-{family}" for family in FAMILIES}
    with _lock(shared):
        if (shared / "runs.json").exists() and not (shared / "done").exists():
            pytest.fail("the torchrun job failed on another pytest-xdist worker (its error is that worker's)")
        if not (shared / "done").exists():  # else another worker ran it
            _sharded_job(shared, roots)
    return roots


def _sharded_job(shared: Path, roots: dict[str, Path]) -> None:
    sharded = []
    for family in FAMILIES:
        root = roots[family]
        root.mkdir()
        # batch_size is per process: 1 on each of the 2 processes is the single-process batch of 2
        runs = [{**COMMON, **keys, "batch_size": 1, "family": family, "output": str(root / f"fsdp-{name}")}
                for name, keys in SCHEDULES.items()]
        resumed = {**runs[-1], "batch_size": 1, "global_batch_size": 2, "output": str(root / "fsdp-resumed")}
        sharded += runs + [{**resumed, "steps": 2}, {**resumed, "resume": True}]
    root, stride4 = roots["flux"], {**COMMON, **SCHEDULES["interval2-stride4"], "family": "flux"}
    sharded += [{**COMMON, **keys, "batch_size": 1, "ddp": True, "family": "flux", "output": str(root / f"ddp-{name}")}
                for name, keys in DDP_RUNS.items()]
    # a 1-process state of 2 steps at batch 2 continues on 2 DDP processes at 1 each
    train(TrainConfig.from_dict({**stride4, "steps": 2, "output": str(root / "ddp-from-one")})[0], log=lambda line: None)
    sharded.append({**stride4, "batch_size": 1, "ddp": True, "resume": True, "output": str(root / "ddp-from-one")})
    spec = shared / "runs.json"
    spec.write_text(json.dumps(sharded))
    _torchrun(str(WORKER), str(spec))
    (shared / "done").touch()


@pytest.fixture(scope="module", params=FAMILIES)
def runs(request, sharded):
    """A family's sharded runs and the single-process runs of the same configs."""
    family, root = request.param, sharded[request.param]
    with _lock(root.parent):
        for name, keys in (SCHEDULES | ONE_ONLY if family == "flux" else SCHEDULES).items():
            if (root / f"one-{name}" / "report.json").exists():  # made already (this worker or another)
                continue
            config = TrainConfig.from_dict({**COMMON, **keys, "family": family, "output": str(root / f"one-{name}")})[0]
            train(config, log=lambda line: None)
    return family, root


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_sharded_losses_and_lora_equal_single_process(runs, schedule):
    family, root = runs
    one, two = root / f"one-{schedule}", root / f"fsdp-{schedule}"
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-5, rel=0)
    assert len(_losses(two)) == 3
    # the norm of the whole model's sharded gradients before clipping, and the clipping, as one process's
    norms = [[step["grad_norm"] for step in json.loads((f / "report.json").read_text())["steps"]] for f in (one, two)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5, abs=0) and min(norms[0]) > COMMON["max_grad_norm"]
    assert json.loads((two / "report.json").read_text())["totals"]["clipped_steps"] == 3
    single, sharded = _lora(one), _lora(two)
    assert sharded.keys() == single.keys() and len(single) > 0
    assert max((single[k] - sharded[k]).abs().max().item() for k in single) <= 1e-5
    assert any(v.abs().max() > 0 for v in sharded.values())
    report = json.loads((two / "report.json").read_text())
    assert report["distributed"] == {"world_size": 2, "backend": "gloo", "fsdp": True,
                                     "checkpointing": "segment runner", "images_per_process": 1, "global_batch": 2,
                                     "memory_scope": "rank 0 (each process holds its shard of the weights)"}
    # the segmented schedule is the one applied, block by block as in the single-process run
    assert report["plan"] == json.loads((one / "report.json").read_text())["plan"]
    assert report["plan"]["applied_by"] == "segment runner" and report["plan"]["mode"] == schedule
    # each process trained its own half of every batch
    assert {step["shape"].split("x")[0] for step in report["steps"]} == {"1"}
    assert {step["shape"].split("x")[0] for step in json.loads((one / "report.json").read_text())["steps"]} == {"2"}
    checkpoint_calls = [step["checkpoint_calls"] for step in report["steps"]]
    assert (checkpoint_calls[0] == 0) == (schedule == "none")
    # every sample of the global batch in the loss by noise level, its error from the rank that trained it
    plain = json.loads((one / "report.json").read_text())
    for ours, theirs in zip(report["steps"], plain["steps"], strict=True):
        assert ours["noise_levels"] == theirs["noise_levels"] and len(ours["sample_losses"]) == 2
        assert ours["sample_losses"] == pytest.approx(theirs["sample_losses"], abs=1e-5, rel=0)
    assert report["loss_by_noise_level"]["samples"] == plain["loss_by_noise_level"]["samples"] == 6


def test_sharded_run_resumes_exactly(runs):
    _, root = runs
    resumed, whole = root / "fsdp-resumed", root / "fsdp-interval2-stride4"
    assert _losses(resumed) == _losses(whole)
    a, b = _lora(resumed), _lora(whole)
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """``family -> folder`` of the single-process run of interval 2 stride 4 to 4 steps (trained once per
    family): what a state of 3 steps continued in one process must equal."""
    folders: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in folders:
            out = folders[family] = tmp_path_factory.mktemp(f"four-{family}") / "one"
            train(TrainConfig.from_dict({**COMMON, **SCHEDULES["interval2-stride4"], "family": family, "steps": 4,
                                         "output": str(out)})[0], log=lambda line: None)
        return folders[family]

    return folder


@pytest.mark.parametrize("runs, folder, tolerance", [(family, "fsdp-resumed", 1e-5) for family in FAMILIES]
                         + [("flux", "ddp-from-one", 1e-6)], indirect=["runs"])
def test_multi_process_state_resumes_in_one_process(runs, four_steps, folder, tolerance, tmp_path):
    """The resumable state an FSDP run (gathered whole) or a DDP run (rank 0's replica) saved
    continues in one process to the single-process result."""
    family, root = runs
    import shutil

    reference = four_steps(family)
    shutil.copytree(root / folder, tmp_path / "run")
    keys = {**COMMON, **SCHEDULES["interval2-stride4"], "family": family, "output": str(tmp_path / "run")}
    # the multi-process run stopped after 3 steps; one process continues it to 4
    result = train(TrainConfig.from_dict({**keys, "steps": 4, "resume": True})[0], log=lambda line: None)
    assert result.resumed_at == 3
    assert [h["loss"] for h in result.history] == pytest.approx(_losses(reference), abs=tolerance, rel=0)
    a, b = _lora(tmp_path / "run"), _lora(reference)
    assert max((a[k] - b[k]).abs().max().item() for k in b) <= tolerance


@pytest.mark.parametrize("runs", ["flux"], indirect=True)
@pytest.mark.parametrize("name", list(DDP_RUNS))
def test_ddp_losses_and_lora_equal_single_process(runs, name):
    _, root = runs
    one, two = root / f"one-{name}", root / f"ddp-{name}"
    assert len(_losses(two)) == 3
    assert _losses(two) == pytest.approx(_losses(one), abs=1e-6, rel=0)
    single, replicated = _lora(one), _lora(two)
    assert replicated.keys() == single.keys() and len(single) > 0
    assert max((single[k] - replicated[k]).abs().max().item() for k in single) <= 1e-6
    assert any(v.abs().max() > 0 for v in replicated.values())
    report, plain = (json.loads((f / "report.json").read_text()) for f in (two, one))
    # clipping after DDP's all-reduce: the averaged gradients' norm, every step clipped as in one process
    assert [s["grad_norm"] for s in report["steps"]] == pytest.approx([s["grad_norm"] for s in plain["steps"]],
                                                                      rel=1e-5, abs=0)
    assert report["totals"]["clipped_steps"] == 3
    assert report["distributed"] == {"world_size": 2, "backend": "gloo", "ddp": True,
                                     "checkpointing": "segment runner", "images_per_process": 1, "global_batch": 2,
                                     "memory_scope": "rank 0 (each process holds a whole replica)"}
    assert {step["shape"].split("x")[0] for step in report["steps"]} == {"1"}
    for ours, theirs in zip(report["steps"], plain["steps"], strict=True):
        assert ours["noise_levels"] == theirs["noise_levels"]
        assert ours["sample_losses"] == pytest.approx(theirs["sample_losses"], abs=1e-6, rel=0)
    streams = name == "stream"
    assert report["plan"]["mode"] == ("layer-stream" if streams else name)
    assert all((step["weight_copies"] > 0) == streams for step in report["steps"])


@pytest.mark.parametrize("runs", ["flux"], indirect=True)
def test_ddp_resumes_a_one_process_state(runs):
    """A state one process saved at batch 2 continues on 2 DDP processes at 1 each, equal to the
    uninterrupted single-process run."""
    _, root = runs
    resumed, whole = root / "ddp-from-one", root / "one-interval2-stride4"
    assert _losses(resumed) == pytest.approx(_losses(whole), abs=1e-6, rel=0) and len(_losses(resumed)) == 3
    a, b = _lora(resumed), _lora(whole)
    assert max((a[k] - b[k]).abs().max().item() for k in b) <= 1e-6
    report = json.loads((resumed / "report.json").read_text())
    assert report["distributed"]["ddp"] and [s["shape"].split("x")[0] for s in report["steps"]] == ["2", "2", "1"]


def test_cli_fsdp_checkpointing_switches_the_schedule_off_once(tmp_path):
    out = tmp_path / "run"
    # the default --batch-size 1 starts on 2 processes: a global batch of 2
    proc = _torchrun("--no-python", "segckpt", "train", "--fsdp", "--fsdp-activation-checkpointing",
                     "--interval", "2", "--stride", "4", "--steps", "2", "--resolution", "64", "--output", str(out))
    text = proc.stdout + proc.stderr
    warning = "fsdp_activation_checkpointing=True: FSDP-style per-block activation checkpointing"
    assert text.count(f"segckpt: warning: {warning}") == 1, text[-4000:]
    assert text.count("step    2/2") == 1  # rank 0 alone prints the steps
    report = json.loads((out / "report.json").read_text())
    plan = report["plan"]
    assert plan["applied_by"] == FSDP_WRAPPER and plan["mode"] == "fsdp-layer"
    assert set(plan["block_map"]) == {"double", "single"} and set("".join(plan["block_map"].values())) == {"C"}
    assert "interval2-stride4" not in json.dumps(plan["lists"]) and plan["notes"][0].startswith(warning)
    assert report["distributed"]["checkpointing"] == FSDP_WRAPPER
    assert (report["distributed"]["images_per_process"], report["distributed"]["global_batch"]) == (1, 2)
    assert report["receipt"]["schedule"] == "fsdp-layer"
    # the runner checkpointed nothing: checkpoint_wrapper did
    assert all(step["checkpoint_calls"] == 0 for step in report["steps"])
    assert sorted(p.name for p in out.iterdir()) == [".segckpt.lock", "cache", "lora.safetensors",
                                                     "lora_comfyui.safetensors", "loss.png", "report.json",
                                                     "sample_data", "training_state.safetensors"]


# --- the options, without a process group -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_outside_torchrun_is_refused_before_any_model(kind, tmp_path, monkeypatch):
    """The ComfyUI node, one process, is refused here too."""
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    config = TrainConfig.create(**{kind: True}, output=str(tmp_path / "o"))
    with pytest.raises(DistributedError, match=rf"^{kind}=True needs the process group torchrun sets up \(RANK, "
                                               rf"WORLD_SIZE.*torchrun --nproc-per-node N --no-python segckpt train "
                                               rf"--{kind} \.\.\."):
        TrainingRun(config)
    with pytest.raises(DistributedError):
        check_launch(kind)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("values, key, allowed", [
    ({"fsdp_activation_checkpointing": True}, "fsdp_activation_checkpointing", "false without fsdp"),
    ({"fsdp": True, "base_model_precision": "int8-torchao"}, "base_model_precision", "bf16, fp32, no_change"),
    ({"fsdp": True, "base_model_precision": "fp16"}, "base_model_precision", "bf16, fp32, no_change"),
    ({"fsdp": True, "gradient_checkpointing_offload_attention": True}, "gradient_checkpointing_offload_attention",
     "false with fsdp"),
    ({"fsdp": True, "buckets": True}, "buckets", "false with fsdp"),
    ({"fsdp": True, "memory_budget": "20"}, "memory_budget", "unset with fsdp"),
    ({"fsdp": "yes"}, "fsdp", "true or false"),
    ({"fsdp": True, "ddp": True}, "ddp", r"false with fsdp=True \(one of them"),
    ({"ddp": True, "memory_budget": "20"}, "memory_budget", "unset with ddp"),
    ({"ddp": True, "fsdp_activation_checkpointing": True}, "fsdp_activation_checkpointing", "false without fsdp"),
])
def test_options_fsdp_cannot_run_are_refused(values, key, allowed):
    with pytest.raises(ConfigError, match=rf"^{key}=.* is invalid: allowed {allowed}"):
        TrainConfig.from_dict(values)


def test_what_fsdp_refuses_runs_under_ddp():
    """DDP leaves the frozen base to each process: quantized, streamed, offloaded, 8-bit states and buckets run."""
    config = TrainConfig.from_dict({"ddp": True, "base_model_precision": "int8-torchao", "buckets": True,
                                    "weight_offload": "stream", "gradient_checkpointing_offload_attention": True,
                                    "optimizer": "adafactor"})[0]
    assert config.sharding.kind == "ddp" and config.schedule.streams and config.data.buckets


def test_a_short_bucket_batch_splits_unevenly_under_ddp():
    """Every rank draws the same bucket; a short batch of 3 (or 1) rows on 2 ranks: the ranks' loss factors
    n * world / batch make their averaged gradients those of the batch's mean loss."""
    ddp = [Distributed(r, 2, r, "gloo", "ddp") for r in range(2)]
    assert [d.share(4) for d in ddp] == [(slice(0, 2), 1.0), (slice(2, 4), 1.0)]
    assert [d.share(3) for d in ddp] == [(slice(0, 2), 4 / 3), (slice(2, 3), 2 / 3)]
    assert [d.share(1) for d in ddp] == [(slice(0, 1), 2.0), (slice(0, 1), 0.0)]
    # the mean of the ranks' weighted means is the batch's mean
    losses = torch.tensor([1.0, 2.0, 6.0])
    assert sum(losses[r].mean() * f for r, f in (d.share(3) for d in ddp)) / 2 == pytest.approx(3.0)
    with pytest.raises(DistributedError, match=r"^batch_size=3 is invalid with fsdp on 2 processes"):
        Distributed(0, 2, 0, "gloo", "fsdp").share(3)


def test_unsloth_backends_are_allowed_sharded():
    config = TrainConfig.from_dict({"fsdp": True, "gradient_checkpointing_backend": "unsloth"})[0]
    assert config.sharding.fsdp and config.schedule.backend.name == "unsloth"


def test_batch_size_is_per_process_and_global_batch_size_is_split():
    assert DataConfig().batch_rows(2) == (1, 2)  # the default batch_size 1 starts on 2 processes
    assert DataConfig(batch_size=3).batch_rows(4) == (3, 12) and DataConfig(batch_size=3).batch_rows() == (3, 3)
    assert DataConfig(global_batch_size=6).batch_rows(2) == (3, 6) and DataConfig(global_batch_size=6).batch_rows() \
        == (6, 6)
    with pytest.raises(ConfigError, match=r"^global_batch_size=3 is invalid with fsdp or ddp on 2 processes: allowed a "
                                          r"multiple of 2"):
        DataConfig(global_batch_size=3).batch_rows(2)
    with pytest.raises(ConfigError, match=r"^global_batch_size=4 is invalid with batch_size=2: allowed unset"):
        TrainConfig.from_dict({"global_batch_size": 4, "train_batch_size": 2})


def test_a_resume_needs_the_saved_global_batch(monkeypatch):
    assert saved_global_batch({"batch_size": 4}) == 4  # a state saved before the per-process batch
    assert saved_global_batch({"batch_size": 1, "processes": 2}) == 2
    assert saved_global_batch({"batch_size": 1, "global_batch_size": 6, "processes": 3}) == 6
    monkeypatch.setenv("WORLD_SIZE", "2")
    sharded = TrainConfig.create(fsdp=True)
    assert processes(sharded.sharding) == 2 and processes(TrainConfig().sharding) == 1  # WORLD_SIZE counts only with fsdp or ddp
    assert processes(TrainConfig.create(ddp=True).sharding) == 2
    check_global_batch(sharded.data, sharded.sharding, {"batch_size": 2})  # 1 per process on 2 = the saved single-process 2
    with pytest.raises(ConfigError, match=r"^resume: batch_size=1 on 2 process\(es\) is a global batch of 2, which "
                                          r"differs from the saved run's 4; allowed batch_size=2 per process or "
                                          r"global_batch_size=4"):
        check_global_batch(sharded.data, sharded.sharding, {"batch_size": 4})


def test_batch_splits_evenly_over_ranks():
    ranks = [Distributed(r, 2, r, "gloo") for r in range(2)]
    assert [d.local_rows(4) for d in ranks] == [slice(0, 2), slice(2, 4)]
    with pytest.raises(DistributedError, match=r"batch_size=3 is invalid with fsdp on 2 processes: allowed a "
                                               r"multiple of 2"):
        ranks[1].local_rows(3)


def test_fsdp_plan_is_per_block_and_warns_only_when_a_schedule_was_asked():
    family = get_family("flux")
    counts = {"double": 2, "single": 3}
    asked = CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=4)
    with pytest.warns(ScheduleWarning, match="model-level schedule \\(interval2-stride4, backend torch\\) is "
                                             "switched off") as caught:
        plan = effective_plan(family, asked, counts, fsdp_checkpointing=True)
    assert len(caught) == 1
    assert plan.applied_by == FSDP_WRAPPER and plan.mode == "fsdp-layer"
    assert plan.block_maps() == {"double": "CC", "single": "CCC"}
    assert [lp.segments for lp in plan.lists] == [((0, 1), (1, 2)), ((0, 1), (1, 2), (2, 3))]
    assert plan.render().startswith("plan (flux, fsdp-layer, applied by fsdp checkpoint_wrapper):")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = effective_plan(family, CheckpointSchedule(gradient_checkpointing=False), counts,
                             fsdp_checkpointing=True)
    assert off.notes == () and off.block_maps() == plan.block_maps()
    assert effective_plan(family, asked, counts).applied_by == "segment runner"
