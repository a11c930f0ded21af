"""SimpleTuner configs mean what they mean there: dashed keys, the web UI's wrapper, the aliases and
their values, the keys spelled alike, the ignored keys (one warning, recorded) and the refusal of a
file that sets nothing this pack reads; docs/OPTIONS.md's list of them is generated from the tables."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import OPTIONS, CheckpointSchedule, ConfigError, ConfigWarning, TrainConfig
from segmented_checkpointing.engine.config.peers.simpletuner import ALIASES, FAMILY_NAMES, IGNORED, NEEDS, SAME_KEYS
from segmented_checkpointing.engine.config.table import simpletuner_table
from segmented_checkpointing.engine.families import family_names
from segmented_checkpointing.engine.model.precision import resolve_precision

ROOT = Path(__file__).resolve().parents[2]
KEYS = {opt.key for opt in OPTIONS}


TAKEN = {"learning_rate": 4e-7, "batch_size": 4, "resolution": 1024, "weight_decay": 0.01, "max_grad_norm": 2.0,
         "caption_dropout": 0.1, "flow_shift": 3.0, "lora_dropout": 0.1, "lora_alpha": 16}
"""SimpleTuner's defaults a flow family's file takes, by our key (docs/OPTIONS.md's table, restated)."""


def _taken_warning(path, **changed) -> str:
    taken = {"learning_rate": 4e-7, "train_batch_size": 4, "resolution": 1024, "adam_weight_decay": 0.01,
             "max_grad_norm": 2.0, "caption_dropout_probability": 0.1, "flow_schedule_shift": 3.0, "lora_dropout": 0.1,
             "lora_alpha": 16, **changed}
    return (f"config {path} is read as SimpleTuner's: its defaults are taken for the keys it leaves out (docs/OPTIONS.md "
            f"\"SimpleTuner configs\"): {', '.join(f'{k}={v!r}' for k, v in taken.items() if v is not None)}")


def _file(tmp_path, values, name="config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return path


def test_dashed_keys_read_as_ours_and_as_schedule_keys():
    config, ignored = TrainConfig.from_dict({"--max_train_steps": 7, "--lora_rank": 4, "--seed": 9,
                                             "--gradient_checkpointing_interval": "3"})
    assert (config.steps, config.lora.rank, config.seed, ignored) == (7, 4, 9, [])
    assert config.schedule.mode == "interval3"  # the demo's stride is not carried over
    schedule = CheckpointSchedule.from_config({"--gradient_checkpointing_interval": 2,
                                               "--gradient_checkpointing_segment_stride": "4"})
    assert (schedule.interval, schedule.stride) == (2, 4)
    with pytest.raises(ConfigError, match=r"^steps=2 is invalid: 'steps' is already set \(1\); allowed each key once"):
        TrainConfig.from_dict({"--steps": 1, "steps": 2})


def test_a_web_ui_file_is_read_from_its_config(tmp_path):
    path = _file(tmp_path, {"_metadata": {"name": "default", "model_family": None},
                            "config": {"--max_train_steps": 12, "--model_family": "qwen_image",
                                       "--train_batch_size": 2, "--output_dir": "out/models",
                                       "--optimizer": "adamw_bf16", "--model_type": "lora"}})
    config, keys = TrainConfig.from_json_file(path)
    assert (config.steps, config.model.family, config.data.batch_size, config.outputs.output) == \
        (12, "qwenimage", 2, "out/models")
    # its optimizer is a key of ours (issue 35), SimpleTuner's AdamW in bf16 read as torch's AdamW
    # the keys it leaves out take SimpleTuner's defaults (issue 35), read as the file's own
    assert keys == {"steps": 12, "family": "qwenimage", "batch_size": 2, "output": "out/models",
                    "optimizer": "adamw_bf16", **{k: v for k, v in TAKEN.items() if k != "batch_size"}}
    assert config.optimizer.name == "adamw"
    assert config.ignored_keys == ()


def test_mixed_precision_no_is_fp32():
    config = TrainConfig.from_dict({"mixed_precision": "no", "base_model_precision": "fp32"})[0]
    assert config.model.mixed_precision == "fp32"
    precision = resolve_precision("fp32", config.model.mixed_precision, torch.device("cpu"))
    assert precision.compute_dtype == torch.float32 and not precision.loss_scaling
    args = cli._parser().parse_args(["train", "--mixed-precision", "no"])
    assert cli.config_from_args(args).model.mixed_precision == "fp32"
    with pytest.raises(ConfigError, match=r"^mixed_precision='fp8' is invalid: allowed auto, bf16, fp32 or no "):
        TrainConfig.from_dict({"mixed_precision": "fp8"})


def test_validation_steps_means_every_n_steps_and_leaves_the_sampler_steps():
    config = TrainConfig.from_dict({"validation_steps": 50, "validation_prompt": "a cat"})[0]
    assert config.validation.validation_every == 50
    assert config.validation.validation_num_inference_steps == 8  # the default, unchanged
    assert config.validation.validation_prompts == ("a cat",)
    sampler = TrainConfig.from_dict({"validation_num_inference_steps": 3})[0].validation
    assert (sampler.validation_every, sampler.validation_num_inference_steps) == (0, 3)


@pytest.mark.parametrize("values", [{"--use_ema": True, "frobnicate": 1}, {}])
def test_a_file_that_sets_nothing_read_here_is_refused(tmp_path, values):
    path = _file(tmp_path, values)
    with pytest.raises(ConfigError, match=r"^config='.*config.json' is invalid: it sets no key this pack reads "
                                          r"\((frobnicate, use_ema|no key)\)"):
        TrainConfig.from_json_file(path)


def test_ignored_keys_are_named_in_one_warning_and_recorded(tmp_path):
    path = _file(tmp_path, {"--max_train_steps": 3, "--use_ema": True, "frobnicate": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, _ = TrainConfig.from_json_file(path)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert messages == [f"config {path}: ignored keys (no meaning here): use_ema (no EMA copy is kept), frobnicate",
                        _taken_warning(path)]
    assert config.steps == 3 and config.ignored_keys == ("use_ema", "frobnicate")
    # options given after the file keep the record (the report writes it as ignored_config_keys)
    assert config.replace(steps=5).ignored_keys == ("use_ema", "frobnicate")


@pytest.mark.parametrize("key, meant", [
    ("lora_rnak", "lora_rank"), ("Lora-Rank", "lora_rank"), ("stesp", "steps"), ("famliy", "family"),
    ("learning_rat", "learning_rate"), ("max_train_step", "max_train_steps"), ("rank", "lora_rank"), ("lr", "learning_rate"),
])
def test_a_near_miss_of_our_key_is_refused_with_the_key_it_meant(tmp_path, key, meant):
    """Issue 34: ``lora_rnak`` was ignored with a warning and the run trained at the default rank."""
    path = _file(tmp_path, {key: 8, "steps": 3})
    with pytest.raises(ConfigError, match=rf"^{key}=8 is invalid: not a key of this pack; did you mean {meant}[ ?]"):
        TrainConfig.from_json_file(path)


def test_simpletuner_and_unknown_keys_keep_their_one_warning_and_no_simpletuner_key_is_a_near_miss(tmp_path):
    """Keys of SimpleTuner's options close to ours (``framerate``, ``local_rank``, ``lora_type``) and keys
    of no project are still ignored with one warning."""
    path = _file(tmp_path, {"steps": 3, "framerate": 24, "local_rank": 0, "lora_type": "standard",
                            "crepa_scheduler": "cosine", "frobnicate": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, _ = TrainConfig.from_json_file(path)
    assert [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)] == [
        f"config {path}: ignored keys (no meaning here): framerate (the frame rate of its validation videos; clips "
        "are resampled with frame_rate), local_rank, crepa_scheduler, frobnicate", _taken_warning(path)]
    assert config.ignored_keys == ("framerate", "local_rank", "crepa_scheduler", "frobnicate")


def test_a_key_given_twice_in_a_config_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"lora_rank": 8, "steps": 3, "lora_rank": 16}')
    with pytest.raises(ConfigError, match=r"^config='.*twice.json' could not be read as JSON: key 'lora_rank' appears "
                                          r"twice in one object \(8, then 16\); allowed each key once"):
        TrainConfig.from_json_file(path)
    schedule = tmp_path / "schedule.json"
    schedule.write_text('{"gradient_checkpointing_interval": 2, "gradient_checkpointing_interval": 3}')
    with pytest.raises(ValueError, match="key 'gradient_checkpointing_interval' appears twice in one object"):
        CheckpointSchedule.from_json_file(schedule)


@pytest.mark.filterwarnings("ignore::segmented_checkpointing.engine.model.text_encoders.TextEncoderWarning")
def test_the_report_lists_the_ignored_keys(tmp_path):
    from segmented_checkpointing.engine.train.loop import train

    path = _file(tmp_path, {"--max_train_steps": 1, "--resolution": 32, "--lora_rank": 2, "--use_ema": True,
                            "--output_dir": str(tmp_path / "run"), "frobnicate": 1})
    with pytest.warns(ConfigWarning):
        config, _ = TrainConfig.from_json_file(path)
    train(config.replace(timing_warmup_steps=0), log=lambda line: None)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["ignored_config_keys"] == ["use_ema", "frobnicate"] and len(report["steps"]) == 1
    # it trained with SimpleTuner's defaults for what it left out (the resolution and rank it set are its own)
    assert report["simpletuner_defaults"] == ["learning_rate=4e-07", "train_batch_size=4", "adam_weight_decay=0.01",
                                              "max_grad_norm=2.0", "caption_dropout_probability=0.1",
                                              "flow_schedule_shift=3.0", "lora_dropout=0.1", "lora_alpha=2"]
    ran = report["config"]
    assert (ran["learning_rate"], ran["batch_size"], ran["max_grad_norm"], ran["caption_dropout"], ran["flow_shift"],
            ran["resolution"], ran["lora"]["alpha"]) == (4e-7, 4, 2.0, 0.1, "3.0", 32, 2)


def test_the_cli_reads_a_simpletuner_file_and_warns_once(tmp_path, capsys):
    path = _file(tmp_path, {"--max_train_steps": 4, "--mixed_precision": "no", "--validation_steps": 2,
                            "--report_to": "wandb"})
    with pytest.warns(ConfigWarning) as caught:
        config = cli.config_from_args(cli._parser().parse_args(["train", "--config", str(path), "--rank", "4"]))
    assert (config.steps, config.model.mixed_precision, config.validation.validation_every, config.lora.rank) == \
        (4, "fp32", 2, 4)
    assert [str(w.message) for w in caught] == [f"config {path}: ignored keys (no meaning here): report_to (no "
                                                "trackers)", _taken_warning(path)]
    bad = _file(tmp_path, {"--frobnicate": 1}, "bad.json")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert "it sets no key this pack reads (frobnicate)" in capsys.readouterr().err


def test_alias_values_read_with_their_simpletuner_meaning():
    read = lambda **values: TrainConfig.from_dict(values)  # noqa: E731
    assert read(resume_from_checkpoint="latest")[0].outputs.resume is True
    assert read(resume_from_checkpoint="None")[0].outputs.resume is False
    assert read(pretrained_model_name_or_path="/m/flux1-dev.safetensors", pretrained_vae_model_name_or_path="/v")[0] \
        .model.model_file == "/m/flux1-dev.safetensors"
    assert read(pretrained_model_name_or_path="/m/flux-dev")[0].model.model_path == "/m/flux-dev"
    assert read(attention_mechanism="native-math")[0].model.attention_backend == "math"
    assert read(attention_mechanism="diffusers")[0].model.attention_backend == "auto"
    assert read(lr_scheduler="constant_with_warmup", lr_warmup_steps=10)[0].optimizer.lr_scheduler == "constant"
    assert read(checkpoint_step_interval=25)[0].outputs.save_every == 25
    assert read(adam_weight_decay=0.01, instance_data_dir="/d")[0].optimizer.weight_decay == 0.01
    assert read(gradient_checkpointing=True)[0].schedule.mode == "layer"  # SimpleTuner's meaning: every block
    assert read(gradient_checkpointing="false")[0].schedule.mode == "none"
    # a key of ours wins over SimpleTuner's, which is then named as ignored
    config, ignored = read(steps=5, max_train_steps=9)
    assert config.steps == 5 and ignored == ["max_train_steps"]
    assert read(num_train_epochs=3, max_train_steps=9)[1] == ["num_train_epochs"]


@pytest.mark.parametrize("values, message", [
    ({"optimizer": "lion"}, r"^optimizer='lion' is invalid: allowed adamw, adamw8bit, adafactor, prodigy\.$"),
    ({"model_type": "full"}, r"^model_type='full' is invalid: allowed lora \(this pack trains LoRAs\)"),
    ({"lora_type": "lycoris"}, r"^lycoris_config='config/lycoris_config.json' is invalid: allowed a readable "
                               r"LyCORIS JSON file"),
    ({"resume_from_checkpoint": "out/checkpoint-100"}, r"^resume_from_checkpoint='out/checkpoint-100' is invalid: "
                                                       r"allowed latest"),
    ({"attention_mechanism": "xformers"}, r"^attention_mechanism='xformers' is invalid: allowed diffusers, "),
    ({"checkpointing_steps": 5, "checkpoint_step_interval": 6}, r"^checkpoint_step_interval=6 is invalid with "
                                                                r"checkpointing_steps=5: both set save_every"),
    ({"num_train_epochs": 3}, r"^num_train_epochs=3 is not read here \(steps are counted, not epochs: set "
                              r"max_train_steps\): allowed together with steps"),
    ({"data_backend_config": "multidatabackend.json"}, r"^data_backend_config='multidatabackend.json' is not read "
                                                       r"here .*allowed together with data"),
])
def test_values_without_a_meaning_here_are_refused_by_name(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(values)


def test_the_tables_name_what_exists():
    assert set(FAMILY_NAMES.values()) <= set(family_names())
    for alias in ALIASES.values():
        assert alias.key not in KEYS  # an alias is not one of our own keys
        assert alias.ours.startswith("(") or set(alias.ours.split(", ")) <= KEYS, alias
    assert set(SAME_KEYS) <= KEYS
    assert not set(IGNORED) & (KEYS | set(ALIASES)) and set(NEEDS) <= set(IGNORED) and set(NEEDS.values()) <= KEYS


def test_the_options_page_holds_the_generated_simpletuner_keys():
    page = (ROOT / "docs" / "OPTIONS.md").read_text()
    section = page.split("\n## SimpleTuner configs\n")[1]
    assert simpletuner_table() in section
    assert "| `validation_steps` | `validation_every` |" in simpletuner_table()


def test_numbers_written_as_strings_are_read_as_numbers():
    """SimpleTuner's CLI-style files quote numbers: "1024", "1e-4" mean the numbers; a string that
    is not one (or a fraction for an integer option) is still refused naming it."""
    config, _ = TrainConfig.from_dict({"resolution": "32", "learning_rate": "1e-4", "max_train_steps": "7",
                                       "--lora_rank": "4"})
    assert (config.data.resolution, config.steps, config.lora.rank) == (32, 7, 4)
    assert config.to_dict()["learning_rate"] == 1e-4
    for bad in ({"resolution": "32.5"}, {"resolution": "big"}, {"steps": "1e2"}):
        with pytest.raises(ConfigError, match=f"={next(iter(bad.values()))!r} is invalid"):
            TrainConfig.from_dict(bad)


def _lycoris(tmp_path, **values) -> str:
    path = tmp_path / "lycoris_config.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_each_recipe_key_reads_with_its_simpletuner_meaning(tmp_path):
    """Issue 35: SimpleTuner's noise-schedule, guidance, clipping, dropout, optimizer and LyCORIS keys."""
    def read(**values):
        return TrainConfig.from_dict({"model_family": "flux", **values})[0]
    shift = lambda **values: read(**values).objective.flow_shift  # noqa: E731
    assert shift(flow_schedule_shift=2.5) == "2.5"
    assert shift(flow_schedule_shift=2.5, flow_schedule_auto_shift=True) == "2.5"  # a static shift > 0 wins
    assert shift(flow_schedule_shift=0, flow_schedule_auto_shift=True) == "auto"
    assert shift(flow_schedule_auto_shift="true") == "auto"  # not the static default
    assert shift(flow_schedule_shift=0) == "1.0" and shift() == "3.0"  # 0: none; left out: SimpleTuner's 3
    objective = read(flow_use_uniform_schedule=True, flow_sigmoid_scale=0.8, flux_guidance_value=3.5).objective
    assert (objective.timestep_sampling, objective.logit_std, objective.guidance_value) == ("uniform", 0.8, 3.5)
    config = read(max_grad_norm=0.5, caption_dropout_probability=0.25, optimizer="bnb-adamw8bit", use_dora=True)
    assert (config.optimizer.max_grad_norm, config.data.caption_dropout, config.optimizer.name, config.lora.use_dora) \
        == (0.5, 0.25, "adamw8bit", True)
    lokr = read(lora_type="lycoris", lycoris_config=_lycoris(tmp_path, algo="lokr", linear_dim=8, linear_alpha=4,
                                                             factor=4, multiplier=1.0, bypass_mode=True)).lora
    assert (lokr.lora_type, lokr.rank, lokr.alpha, lokr.factor, lokr.dropout) == ("lokr", 8, 4, 4, 0)
    loha = read(lora_type="lycoris", lycoris_config=_lycoris(tmp_path, algo="loha", linear_dim=4)).lora
    assert (loha.lora_type, loha.rank, loha.alpha) == ("loha", 4, 4)  # alpha left out: SimpleTuner's, the rank
    assert read(lora_type="standard", lycoris_config="unread.json").lora.lora_type == "lora"
    # SimpleTuner's LoKr examples: full matrices (rank and alpha unused, as LyCORIS ignores them there)
    for full in ({"full_matrix": True, "linear_alpha": 1}, {"linear_dim": 10000, "linear_alpha": 1}):
        lokr = read(lora_type="lycoris", lycoris_config=_lycoris(tmp_path, algo="lokr", factor=16, **full)).lora
        assert (lokr.lora_type, lokr.full_matrix, lokr.factor) == ("lokr", True, 16)


@pytest.mark.parametrize("lycoris, message", [
    ({"algo": "locon"}, r"algo='locon' is invalid: allowed lokr or loha"),
    ({"algo": "loha", "full_matrix": True}, r"full_matrix=True is invalid: allowed true or false; true with algo lokr"),
    ({"algo": "lokr", "apply_preset": {"module_algo_map": {"Attention": {"factor": 16}}}},
     r"apply_preset=.* is invalid: allowed no module_algo_map"),
    ({"algo": "loha", "linear_dim": 10000}, r"linear_dim=10000 is invalid: allowed an integer from 1 to 4096"),
    ({"algo": "loha", "factor": 8}, r"factor=8 is invalid: allowed -1 with algo loha"),
    ({"algo": "lokr", "dropout": 0.1}, r"dropout=0.1 is invalid: allowed only algo, linear_dim"),
])
def test_a_lycoris_config_this_pack_cannot_train_is_refused_naming_the_key(tmp_path, lycoris, message):
    path = _lycoris(tmp_path, **lycoris)
    with pytest.raises(ConfigError, match=rf"^lycoris_config {path}: {message}"):
        TrainConfig.from_dict({"lora_type": "lycoris", "lycoris_config": path})


@pytest.mark.parametrize("scheme, sampling, weighting", [
    ("logit_normal", "logit_normal", "none"), ("mode", "mode", "none"), ("none", "uniform", "none"),
    ("sigma_sqrt", "uniform", "sigma_sqrt"), ("cosmap", "uniform", "cosmap")])
def test_diffusers_script_names_read_as_their_scripts_mean_them(scheme, sampling, weighting):
    config = TrainConfig.from_dict({"weighting_scheme": scheme, "logit_mean": 0.5, "mode_scale": 1.0,
                                    "guidance_scale": 3.5, "family": "flux"})[0]
    objective = config.objective
    assert (objective.timestep_sampling, objective.loss_weighting, objective.logit_mean, objective.mode_scale,
            objective.guidance_value) == (sampling, weighting, 0.5, 1.0, 3.5)
    assert config.simpletuner_defaults == () and config.optimizer.learning_rate == 1e-3  # not a SimpleTuner file
    with pytest.raises(ConfigError, match=r"^weighting_scheme='karras' is invalid: allowed none, logit_normal, mode"):
        TrainConfig.from_dict({"weighting_scheme": "karras"})
    with pytest.raises(ConfigError, match=r"^weighting_scheme=\[\] is invalid: allowed none, logit_normal"):
        TrainConfig.from_dict({"weighting_scheme": []})  # not a name (found by tests/config/test_fuzz.py)


def _ours(config: TrainConfig, key: str):
    return config.to_dict()["lora"][key.removeprefix("lora_")] if key.startswith("lora_") else config.to_dict()[key]


@pytest.mark.parametrize("family", ["flux", "unet2dcondition"])
def test_a_file_that_leaves_keys_out_takes_simpletuners_defaults_from_the_table(family):
    """The defaults table (docs/OPTIONS.md, generated from ``DEFAULTS``) is what a file that sets none of
    its keys trains with; the flow shift only for a flow family, the rank's alpha for the rank."""
    from segmented_checkpointing.engine.config.peers.recipe import DEFAULTS

    config = TrainConfig.from_dict({"model_family": family, "lora_rank": 8})[0]
    for default in DEFAULTS:
        ours = default.ours.split()[0]
        if default.key == "flow_schedule_shift" and family != "flux":
            assert _ours(config, ours) == "auto"  # an epsilon family takes no flow default
        elif default.key == "lora_alpha":
            assert _ours(config, ours) == 8  # None in SimpleTuner: the rank
        else:
            assert float(_ours(config, ours)) == default.value, default
    assert len(config.simpletuner_defaults) == len(DEFAULTS) - (family != "flux")
    kept = TrainConfig.from_dict({"model_family": family, "learning_rate": 1e-4, "train_batch_size": 1})[0]
    assert (kept.optimizer.learning_rate, kept.data.batch_size) == (1e-4, 1)  # what a file sets is its own
