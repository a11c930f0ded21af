"""The ``segckpt`` command line: errors before any model is built, precedence, a short real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import refuse_to_build_models
from PIL import Image
from safetensors.torch import load_file

from segmented_checkpointing import cli, console
from segmented_checkpointing.engine.train.state import load_state


@pytest.fixture
def no_model(monkeypatch):
    refuse_to_build_models(monkeypatch, "the options were validated")


@pytest.mark.parametrize("argv, key", [
    (["--interval", "0"], "gradient_checkpointing_interval=0"),
    (["--interval", "3", "--stride", "2"], "gradient_checkpointing_segment_stride=2"),
    (["--backend", "deepspeed"], "gradient_checkpointing_backend='deepspeed'"),
    (["--interval", "none", "--stride", "4"], "gradient_checkpointing_segment_stride=4"),
    (["--steps", "0"], "steps=0"),
    (["--family", "dalle"], "family='dalle'"),
    (["--data", "/no/such/folder"], "data='/no/such/folder'"),
    (["--rank", "0"], "lora_rank=0"),
    (["--lr-scheduler", "step"], "lr_scheduler='step'"),
    (["--base-precision", "int4"], "base_model_precision='int4'"),
    (["--base-precision", "bf16", "--mixed-precision", "fp32"], "mixed_precision=fp32 is invalid with base_model_precision='bf16'"),
    (["--attention-backend", "flash,sage"], "attention_backend='flash,sage' is invalid (unknown 'sage')"),
    (["--attention-backend", "cudnn,efficient"], "attention_backend='cudnn,efficient' is invalid on the CPU"),
    (["--on-nonfinite", "ignore"], "on_nonfinite='ignore'"),
])
def test_invalid_options_fail_before_any_model(no_model, capsys, argv, key, tmp_path):
    assert cli.main(["train", "--output", str(tmp_path), *argv]) == 2
    assert key in capsys.readouterr().err


def test_resume_without_state_is_refused(no_model, capsys, tmp_path):
    assert cli.main(["train", "--output", str(tmp_path), "--resume"]) == 2
    assert "training_state.safetensors" in capsys.readouterr().err


def test_precedence_defaults_config_options(tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"max_train_steps": 7, "gradient_checkpointing_interval": 3,
                                  "lora_rank": 8, "some_simpletuner_key": 1}))
    args = cli._parser().parse_args(["train", "--config", str(config), "--rank", "4"])
    result = cli.config_from_args(args)
    assert (result.steps, result.lora.rank, result.schedule.interval) == (7, 4, 3)
    assert result.schedule.gradient_checkpointing_segment_stride is None  # --interval alone unsets the stride
    default = cli.config_from_args(cli._parser().parse_args(["train"]))
    assert default.schedule.mode == "interval2-stride4" and default.model.family == "flux" and default.steps == 20


def test_short_real_run(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", "--steps", "3", "--resolution", "64", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "double  CC..CC..  segments: 0-1 4-5" in printed and "legend" in printed
    assert printed.count(" s/step ") == 3 and "peak" in printed
    report = json.loads((out / "report.json").read_text())
    assert [p["segments"] for p in report["plan"]["lists"]] == [[[0, 2], [4, 6]], [[0, 2], [4, 6]]]
    lora = load_file(out / "lora.safetensors")
    assert lora and not any(".default." in k for k in lora)
    assert (out / "training_state.safetensors").is_file()
    # the recipe line first; loss.png draws the loss and, beneath it, each non-empty noise-level bin
    assert printed.index("recipe: logit_normal(0, 1), flow_shift auto") < printed.index("step    1/3")
    assert f"loss graph: {out / 'loss.png'}" in printed
    bins = report["loss_by_noise_level"]["bins"]
    assert sum(b["count"] for b in bins) == 3 and report["loss_by_noise_level"]["samples"] == 3
    with Image.open(out / "loss.png") as graph:
        assert graph.text["segckpt:noise_bins"] == str(sum(1 for b in bins if b["count"]))
        assert graph.size == (640, 720)


def test_offload_backend_run_reports_offload(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["train", "--steps", "2", "--resolution", "64", "--output", str(out), "--backend", "unsloth",
            "--offload-attention", "--pin-buckets", "4"]
    with pytest.warns(UserWarning):  # pinned host memory is skipped without CUDA; attention-offload scope note
        assert cli.main(argv) == 0
    assert "offload" in capsys.readouterr().out
    steps = json.loads((out / "report.json").read_text())["steps"]
    assert all(s["offloaded_tensors"] > 0 and s["pool_bytes"] > 0 and 0 < s["pool_buckets"] <= 4 for s in steps)


def test_families_matrix_matches_the_committed_docs(capsys):
    from pathlib import Path

    assert cli.main(["families", "--limits"]) == 0
    printed = capsys.readouterr().out
    committed = (Path(__file__).resolve().parents[2] / "docs" / "FAMILIES.md").read_text()
    assert printed == committed, ("docs/FAMILIES.md is stale: regenerate with "
                                  "`segckpt families --limits > docs/FAMILIES.md`")
    assert cli.main(["families"]) == 0  # the quick one: all but the limits table
    assert capsys.readouterr().out == committed[:committed.index("## Model limits")] + committed[
        committed.index("## Notes"):]
    for family in ("flux", "sd3", "pixart", "wan", "sana", "qwenimage", "zimage", "lumina2"):
        assert f"| {family} |" in printed


def _short(out, *extra):
    return ["train", "--steps", "2", "--resolution", "64", "--output", str(out), *extra]


def test_recipes_match_the_committed_docs(capsys):
    assert cli.main(["recipes"]) == 0
    committed = (Path(__file__).resolve().parents[2] / "docs" / "RECIPES.md").read_text()
    assert capsys.readouterr().out == committed, "docs/RECIPES.md is stale: regenerate with `segckpt recipes > docs/RECIPES.md`"


def test_existing_run_is_not_overwritten_and_resume_must_match(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(_short(out)) == 0
    before = (out / "lora.safetensors").read_bytes()
    assert cli.main(_short(out)) == 2
    assert "--resume" in capsys.readouterr().err and (out / "lora.safetensors").read_bytes() == before
    assert cli.main(_short(out, "--resume", "--seed", "5")) == 2
    assert "resume: seed=5 differs from the saved run's 0" in capsys.readouterr().err
    assert cli.main(_short(out, "--resume", "--batch-size", "2")) == 2  # the saved run's global batch is 1
    assert "resume: batch_size=2 on 1 process(es) is a global batch of 2, which differs from the saved run's 1" \
        in capsys.readouterr().err
    assert cli.main(["train", "--steps", "1", "--resolution", "64", "--output", str(out), "--resume"]) == 2
    assert "steps=1" in capsys.readouterr().err
    assert cli.main(_short(out, "--overwrite", "--steps", "1")) == 0


@pytest.mark.parametrize("values, key", [
    ({"resume": "false"}, "resume='false'"),
    ({"family": 123}, "family=123"),
    ({"data": 5}, "data=5"),
    ({"lora_target_modules": [1, 2]}, "lora_target_modules=[1, 2]"),
    ({"learning_rate": float("inf")}, "learning_rate=inf"),
])
def test_config_file_values_are_type_checked(no_model, tmp_path, capsys, values, key):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(values))
    assert cli.main(["train", "--config", str(config), "--output", str(tmp_path / "o")]) == 2
    assert key in capsys.readouterr().err


def test_divergence_stops_with_an_error_and_keeps_no_nan_lora(tmp_path, capsys):
    # alpha 1e15 blows the loss up at step 2 (seeds 0-2 checked); far larger ones (1e30)
    # can overflow the gradient norm to inf, and clipping then zeroes the update instead
    for seed in ("0", "1", "2"):
        assert cli.main(_short(tmp_path / f"o{seed}", "--alpha", "1e15", "--lr", "1e10", "--seed", seed)) == 2
        err = capsys.readouterr().err
        assert "training diverged" in err and "non-finite values at step" in err
        step = int(err.split("non-finite values at step ")[1].split(":")[0])
        # the last good step's LoRA and state are kept, with no NaN in them
        lora = load_file(tmp_path / f"o{seed}" / "lora.safetensors")
        state = load_state(tmp_path / f"o{seed}")
        assert state.step == step - 1 >= 1
        assert all(t.isfinite().all() for t in [*lora.values(), *state.lora.values()])


def test_family_is_detected_from_the_model_folder(tmp_path):
    from segmented_checkpointing.engine.model.bundle import build_preset

    bundle = build_preset("sd3")
    bundle.transformer.save_pretrained(tmp_path / "m" / "transformer")
    bundle.vae.save_pretrained(tmp_path / "m" / "vae")
    (tmp_path / "m" / "model_index.json").write_text("{}")
    args = cli._parser().parse_args(["train", "--model-path", str(tmp_path / "m")])
    assert cli.config_from_args(args).model.family == "sd3"


def test_ctrl_c_saves_the_state_and_resume_continues(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "o"
    argv = [sys.executable, "-m", "segmented_checkpointing.cli", "train", "--steps", "40", "--resolution", "64",
            "--output", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step    2/"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    from segmented_checkpointing.engine.train.state import read_state_header

    done = read_state_header(out)["step"]
    assert 2 <= done < 40
    assert cli.main(["train", "--steps", str(done + 1), "--resolution", "64", "--output", str(out), "--resume"]) == 0
    assert read_state_header(out)["step"] == done + 1


def test_only_our_warnings_are_printed_as_ours():
    import warnings

    from segmented_checkpointing.engine.core.plan import ScheduleWarning

    saved = warnings.formatwarning
    try:
        cli.console_messages()
        assert warnings.formatwarning("stride ignored", ScheduleWarning, "x.py", 3) == "segckpt: warning: stride ignored\n"
        torch_line = warnings.formatwarning("Mismatch dtype between input and weight", UserWarning, "torch/nn.py", 7)
        assert not torch_line.startswith("segckpt") and "UserWarning, torch/nn.py:7" in torch_line
    finally:
        warnings.formatwarning = saved


@pytest.mark.parametrize("argv, line", [
    (["train", "--lr", "abc"], "segckpt: error: argument --lr: invalid float value: 'abc' (segckpt train --help "
                               "lists the options)"),
    (["train", "--steps", "2.5"], "segckpt: error: argument --steps: invalid int value: '2.5' (segckpt train --help "
                                  "lists the options)"),
    (["sweep", "--warmup", "x"], "segckpt: error: argument --warmup: invalid int value: 'x' (segckpt sweep --help "
                                 "lists the options)"),
    # issue 34: a train option given to plan named the top-level help, or first the missing --budget
    (["plan", "--budget", "1", "--steps", "2"], "segckpt: error: unrecognized arguments: --steps 2 (segckpt plan "
                                                "--help lists the options)"),
    (["plan", "--steps", "2"], "segckpt: error: unrecognized arguments: --steps 2 (segckpt plan --help lists the "
                               "options)"),
    (["plan", "--lr", "1"], "segckpt: error: the following arguments are required: --budget (segckpt plan --help "
                            "lists the options)"),
])
def test_a_value_argparse_refuses_is_one_line(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_a_cpu_run_whose_user_set_no_threads_gets_every_usable_core_but_one(monkeypatch):
    """Issue 34, item 8: the CLI chooses (and says so once); a user's OMP_NUM_THREADS is kept."""
    import torch

    from segmented_checkpointing.engine import api

    lines, threads = [], torch.get_num_threads()
    monkeypatch.setattr(api, "usable_cores", lambda: 6)
    for name in console.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    try:
        torch.set_num_threads(8)  # torch's default on this imagined machine
        assert cli.cpu_threads(api.TrainConfig.create(device="cpu"), lines.append) == 5
        assert torch.get_num_threads() == 5
        assert lines == ["cpu: 5 threads for torch's operations (6 usable cores, one left for the rest; torch's "
                         "default 8); set OMP_NUM_THREADS to choose"]
        torch.set_num_threads(2)
        monkeypatch.setattr(api, "usable_cores", lambda: 1)
        assert cli.cpu_threads(api.TrainConfig.create(device="cpu"), lines.append) == 1  # at least one
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert cli.cpu_threads(api.TrainConfig.create(device="cpu"), lines.append) is None  # the user's choice
        assert torch.get_num_threads() == 1 and len(lines) == 2
    finally:
        torch.set_num_threads(threads)


def test_the_first_ctrl_c_of_a_plan_stops_after_a_step_and_says_what_was_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C sets a flag polled after every step (a KeyboardInterrupt raised inside a memory
    tracker's callback could be swallowed); during the probe nothing is kept yet."""
    monkeypatch.setattr(cli.StopOnSignal, "__call__", lambda self: True)
    status = cli.main(["plan", "--resolution", "32", "--budget", "device", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("segckpt: interrupted during the probe: nothing was measured yet, "
                                            "nothing written")
    assert not (tmp_path / "plan.txt").exists()


def test_the_command_line_stays_a_front_end():
    """Issue 37: cli.py generates its flags and calls the facade; the measurements' checks live there."""
    assert len(Path(cli.__file__).read_text().splitlines()) <= 350
