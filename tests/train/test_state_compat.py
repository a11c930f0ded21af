"""A run saved by the release before the options became a tree (main at c3f2e24, in
``tests/train/fixtures/release_c3f2e24/``: ``segckpt train --steps 2 --resolution 32 --rank 2
--interval 2 --stride 4``) resumes under the current code, and the keys of the saved state's config
and of ``report.json`` are the ones that release wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.config.schedule import STREAM_KEYS, CheckpointSchedule

RELEASE = Path(__file__).resolve().parent / "fixtures" / "release_c3f2e24"
ARGS = ["--resolution", "32", "--rank", "2", "--interval", "2", "--stride", "4", "--flow-shift", "1",
        "--max-grad-norm", "0"]
"""The release's options; ``--flow-shift 1``: it drew its noise levels unshifted, ``--max-grad-norm 0``: it did
not clip (issue 35's defaults are auto and 1)."""
ADDED = {"global_batch_size", "validation_num_inference_steps", "on_data_change", "lora_format",
         "num_frames", "frame_rate", "frame_sampling", "frame_buckets", "min_frames", "validation_frames",
         "compile_blocks", "timestep_sampling", "logit_mean", "logit_std", "mode_scale", "flow_shift",
         "loss_weighting", "snr_gamma", "guidance_value", "optimizer", "max_grad_norm", "caption_dropout", "ddp"}
"""Config keys new since that release (issue 22: the batch over all processes; the preview sampler's
steps under SimpleTuner's name, since SimpleTuner's ``validation_steps`` is ``validation_every``;
what a resume does when the data changed; issue 23: which LoRA files a run writes; issue 24: the
frame options of video families; issue 25: per-block compile; issue 35: the noise schedule, the
optimizer, gradient clipping and caption dropout; issue 36: ddp)."""
REMOVED = {"validation_steps"}


def test_a_state_of_the_last_release_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(RELEASE / "training_state.safetensors", out)
    # it drew unshifted noise levels and did not clip: today's defaults (auto: Flux's own shift; max_grad_norm
    # 1) would change the run mid-way
    without_shift = [a for a in ARGS if a not in ("--flow-shift", "1")]
    assert cli.main(["train", "--steps", "3", "--resume", "--output", str(out), *without_shift]) == 2
    assert "resume: flow_shift='auto' differs from the saved run's '1.0'" in capsys.readouterr().err
    without_clip = [a for a in ARGS if a not in ("--max-grad-norm", "0")]
    assert cli.main(["train", "--steps", "3", "--resume", "--output", str(out), *without_clip]) == 2
    assert ("resume: max_grad_norm=1.0 differs from the saved run's 0.0; allowed the saved value"
            in capsys.readouterr().err)
    assert cli.main(["train", "--steps", "3", "--resume", "--output", str(out), *ARGS]) == 0
    report = json.loads((out / "report.json").read_text())
    old = json.loads((RELEASE / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert [s["loss"] for s in report["steps"][:2]] == [s["loss"] for s in old["steps"]]  # the saved history
    assert set(report) == set(old) | {"ignored_config_keys", "resume", "lora_files", "compile", "optimizer",
                                      "simpletuner_defaults", "recipe", "loss_by_noise_level"}
    assert report["ignored_config_keys"] == [] and set(report["lora_files"]) == {"diffusers", "comfyui"}
    assert report["resume"] is None  # a state saved before fingerprints: nothing to compare, nothing changed
    assert set(report["config"]) == set(old["config"]) - REMOVED | ADDED
    # the steps trained by this run and where it resumed are new since that release (a resume with nothing left)
    # ... and the latent tokens per sample (issue 24), the clipped steps and dropped captions (issue 35)
    assert set(report["totals"]) == set(old["totals"]) | {"trained_steps", "resumed_at_step", "tokens_per_sample",
                                                          "clipped_steps", "dropped_captions"}
    assert report["optimizer"] == {"name": "adamw", "class": "torch.optim.adamw.AdamW"}
    assert (report["totals"]["trained_steps"], report["totals"]["resumed_at_step"]) == (1, 2)
    # the host arena's allocated/used bytes and the device memory free at the start are new (issue 36)
    assert set(report["memory"]) == set(old["memory"]) | {"host_arena", "device_free_bytes_at_start"}


def test_the_saved_config_keeps_the_flat_keys_of_the_last_release():
    with safe_open(str(RELEASE / "training_state.safetensors"), "pt") as state:
        saved = json.loads(state.metadata()["config"])
    current = TrainConfig.create(resolution=32, lora_rank=2, steps=2).to_dict()
    assert set(saved) == set(current) - ADDED | REMOVED
    # the adapter type, DoRA, the LoKr factor and full matrix (issue 35) are new since that release; its LoRA reads as a plain LoRA
    assert set(current["lora"]) - set(saved["lora"]) == {"lora_type", "use_dora", "factor", "full_matrix"} and set(saved["lora"]) < set(current["lora"])
    # the three weight-streaming keys (issue 21) and save_attention (issue 25) are new since that release;
    # its schedule reads as not streaming and keeping no attention outputs
    assert set(current["schedule"]) - set(saved["schedule"]) == set(STREAM_KEYS) | {"gradient_checkpointing_save_attention"}
    assert not CheckpointSchedule.from_config(saved["schedule"]).gradient_checkpointing_save_attention
    assert set(saved["schedule"]) <= set(current["schedule"])
    assert not CheckpointSchedule.from_config(saved["schedule"]).streams
    config, ignored = TrainConfig.from_dict({k: v for k, v in saved.items() if k not in ("lora", "schedule")})
    # its validation_steps (the sampler's, then) is SimpleTuner's validation_every, which the saved key of ours sets
    assert ignored == ["validation_steps"] and config.validation.validation_every == saved["validation_every"]
