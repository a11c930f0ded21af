"""The pack's ComfyUI nodes (classic ``NODE_CLASS_MAPPINGS`` API, ComfyUI 0.3.64 and newer).

Each node converts its inputs to an engine config, calls one engine entry point and wraps the
result; no training logic lives here. Tooltips come from the engine's help texts, so the CLI's
``--help`` and the node UI say the same thing.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..engine.core.backends import BACKENDS
from ..engine.core.plan import check_supported
from ..engine.core.schedule import HELP as SCHEDULE_HELP
from ..engine.core.schedule import CheckpointSchedule, ScheduleError
from ..engine.families import TextBatch, family_names, get_family
from ..engine.measure.guarded import guarded_train
from ..engine.train.attention_kernels import (
    AttentionBackendError,
    parse_attention_backend,
)
from ..engine.train.buckets import sample_latent_shape
from ..engine.train.config import HELP, LR_SCHEDULERS, ConfigError, TrainConfig
from ..engine.train.data import write_sample_dataset
from ..engine.train.loop import load_bundle
from ..engine.train.lora_io import LoraSettings, save_lora
from ..engine.train.nonfinite import POLICIES as NONFINITE_POLICIES
from ..engine.train.precision import BASE_PRECISIONS
from ..engine.train.prepared import comfy_latent_format, prepare_comfy_data
from ..engine.train.validation import PreviewSource
from .environment import (
    BUILTIN_DATA,
    TINY_PRESET,
    NodeError,
    PathError,
    contained,
    current_host,
    latest_run,
    model_files,
    model_folders,
    next_file,
    numbered_run,
    public_errors,
    resolve_model,
)
from .guardrail_nodes import GUARDRAILS

CATEGORY = "training/gradient checkpointing"
MODEL, DATASET, SCHEDULE = "SEGCKPT_MODEL", "SEGCKPT_DATASET", "SEGCKPT_SCHEDULE"
OFFLOAD, LORA_CONFIG, RUN = "SEGCKPT_OFFLOAD", "SEGCKPT_LORA_CONFIG", "SEGCKPT_TRAINING_RUN"


def _tip(text: str, **spec: Any) -> dict:
    return {"tooltip": text, **spec}


class LoadDiffusionModel:
    """A diffusers folder under ``models/diffusers``, one ``.safetensors`` file under
    ``models/diffusion_models``, ``models/unet`` or ``models/checkpoints`` (shown as
    ``diffusion_models/<file>``, ``checkpoints/<file>``), or the family's tiny random-init preset."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "load", (MODEL,), ("model",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (family_names(), _tip(HELP["family"], default="flux")),
            "source": ([TINY_PRESET] + model_folders(current_host()) + model_files(current_host()),
                       _tip("A diffusers folder under models/diffusers; a .safetensors file under "
                            "models/diffusion_models, unet or checkpoints (original release or diffusers layout; "
                            "the variant is read from its shapes; training then needs a VAE, which a single file "
                            "does not hold); or the tiny random-init preset.")),
            "seed": ("INT", _tip("Seed of the preset's random init.", default=0, min=0, max=2**31 - 1)),
            "base_model_precision": (list(BASE_PRECISIONS), _tip(HELP["base_model_precision"], default="auto")),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, source):
        if source != TINY_PRESET:
            try:
                resolve_model(current_host(), source)
            except PathError as exc:
                return current_host().public(str(exc))
        return True

    @public_errors
    def load(self, family, source, seed, base_model_precision="auto"):
        # a folder or file loads straight into its storage dtype; quantizing (on the training device)
        # and casting a preset happen in Train LoRA, on its copy
        path = None if source == TINY_PRESET else resolve_model(current_host(), source)
        where = {} if path is None else {"model_file": str(path)} if path.is_file() else {"model_path": str(path)}
        config = TrainConfig(family=family, seed=seed, base_model_precision=base_model_precision, **where)
        with torch.inference_mode(False):  # weights must not become inference tensors
            return (load_bundle(config),)


class ImageCaptionDataset:
    """A folder of images with same-name ``.txt`` captions under ComfyUI's input folder."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (DATASET,), ("dataset",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "folder": ("STRING", _tip(f"Folder under ComfyUI's input folder; {BUILTIN_DATA} = photographs "
                                      "shipped with scikit-image.", default=BUILTIN_DATA)),
            "resolution": ("INT", _tip(HELP["resolution"], default=256, min=16, max=4096, step=16)),
            "buckets": ("BOOLEAN", _tip(HELP["buckets"], default=False)),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, folder):
        if folder == BUILTIN_DATA:
            return True
        try:
            path = contained(current_host().input_dir, folder, "folder")
        except PathError as exc:
            return current_host().public(str(exc))
        return True if path.is_dir() else f"folder={folder!r} is invalid: no such folder under the input folder"

    @public_errors
    def build(self, folder, resolution, buckets=False):
        host = current_host()
        if folder == BUILTIN_DATA:  # written once per server and shared by its runs
            path = str(write_sample_dataset(host.output_dir / "segckpt" / "sample_data"))
        else:
            path = str(contained(host.input_dir, folder, "folder"))
        return ({"data": path, "resolution": resolution, "buckets": buckets},)


class GradientCheckpointingSchedule:
    """The six gradient-checkpointing keys (SimpleTuner names) for one family; 0 = unset for
    interval and stride. Outputs ``{"family": name, "schedule": CheckpointSchedule}``."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (SCHEDULE,), ("schedule",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (family_names(), _tip(
                "Family this schedule is for: the block strip shows its plan, and a backend the family "
                "cannot run is refused when the prompt is queued. Train LoRA refuses a model of another "
                "family.", default="flux")),
            "gradient_checkpointing": ("BOOLEAN", _tip(SCHEDULE_HELP["gradient_checkpointing"], default=True)),
            "gradient_checkpointing_backend": (list(BACKENDS), _tip(SCHEDULE_HELP["gradient_checkpointing_backend"])),
            "gradient_checkpointing_interval": ("INT", _tip(SCHEDULE_HELP["gradient_checkpointing_interval"]
                                                            + " 0 = unset.", default=2, min=0, max=1024)),
            "gradient_checkpointing_segment_stride": ("INT", _tip(SCHEDULE_HELP["gradient_checkpointing_segment_stride"]
                                                                  + " 0 = unset.", default=4, min=0, max=1024)),
            "gradient_checkpointing_offload_attention": ("BOOLEAN", _tip(
                SCHEDULE_HELP["gradient_checkpointing_offload_attention"], default=False)),
            "gradient_checkpointing_offload_pin_memory_max_buckets": ("INT", _tip(
                SCHEDULE_HELP["gradient_checkpointing_offload_pin_memory_max_buckets"], default=12, min=0, max=1024)),
        }}

    @staticmethod
    def schedule(family=None, **keys) -> CheckpointSchedule:
        """The :class:`CheckpointSchedule` of the node's widget values (0 = unset).

        Raises:
            ScheduleError: a key is invalid, or the family cannot run it (see
                :func:`~segmented_checkpointing.engine.core.plan.check_supported`).
        """
        for key in ("gradient_checkpointing_interval", "gradient_checkpointing_segment_stride"):
            if key in keys:
                keys[key] = keys[key] or None
        schedule = CheckpointSchedule(**keys)
        if family is not None:
            check_supported(get_family(family), schedule)
        return schedule

    @classmethod
    def VALIDATE_INPUTS(cls, family, gradient_checkpointing_backend, gradient_checkpointing_interval,
                        gradient_checkpointing_segment_stride, gradient_checkpointing_offload_attention):
        # ComfyUI checks combos, booleans and INT bounds itself; the keys that can be wrong together
        # are checked here. A returned message would be listed once per input named in this
        # signature, so the error is raised: ComfyUI then reports it once, for this node.
        try:
            cls.schedule(family, gradient_checkpointing_backend=gradient_checkpointing_backend,
                         gradient_checkpointing_interval=gradient_checkpointing_interval,
                         gradient_checkpointing_segment_stride=gradient_checkpointing_segment_stride,
                         gradient_checkpointing_offload_attention=gradient_checkpointing_offload_attention)
        except (ScheduleError, KeyError) as exc:
            raise NodeError(str(exc).strip("'\"")) from None
        return True

    def build(self, family, **keys):
        return ({"family": family, "schedule": self.schedule(family, **keys)},)


class ActivationOffloadOptions:
    """Offload options that override the schedule's when connected to Train LoRA."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (OFFLOAD,), ("offload",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "gradient_checkpointing_backend": (list(BACKENDS), _tip(SCHEDULE_HELP["gradient_checkpointing_backend"],
                                                                    default="unsloth")),
            "gradient_checkpointing_offload_attention": ("BOOLEAN", _tip(
                SCHEDULE_HELP["gradient_checkpointing_offload_attention"], default=True)),
            "gradient_checkpointing_offload_pin_memory_max_buckets": ("INT", _tip(
                SCHEDULE_HELP["gradient_checkpointing_offload_pin_memory_max_buckets"], default=12, min=0, max=1024)),
        }}

    def build(self, **keys):
        return (keys,)


class LoRAConfig:
    """LoRA rank, alpha, dropout and target modules (peft)."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (LORA_CONFIG,), ("lora_config",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "rank": ("INT", _tip(HELP["lora_rank"], default=16, min=1, max=1024)),
            "alpha": ("FLOAT", _tip(HELP["lora_alpha"], default=16.0, min=0.001, max=4096.0)),
            "dropout": ("FLOAT", _tip(HELP["lora_dropout"], default=0.0, min=0.0, max=0.99, step=0.01)),
            "target_modules": ("STRING", _tip(HELP["lora_target_modules"] + " Comma-separated; empty = default.",
                                              default="")),
        }}

    def build(self, rank, alpha, dropout, target_modules):
        targets = tuple(t.strip() for t in target_modules.split(",") if t.strip()) or None
        return (LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets),)


UNLINKED = "(not connected)"
"""Default of a data input VALIDATE_INPUTS names: ComfyUI leaves an unconnected optional input out."""


def data_source(dataset: bool, latent: bool, conditioning: bool) -> str:
    """Which data Train LoRA trains on: ``dataset`` or ``latent`` (with conditioning).

    Raises:
        ValueError: both sources, neither, or latent without conditioning (or the reverse),
            naming the node's inputs.
    """
    if dataset and (latent or conditioning):
        raise ValueError("Train LoRA takes one data source: dataset, or latent + conditioning; both are "
                         "connected: disconnect one")
    if latent != conditioning:
        have, need = ("latent", "conditioning") if latent else ("conditioning", "latent")
        raise ValueError(f"Train LoRA input {have} is connected without {need}: connect {need} too (or use dataset)")
    if not (dataset or latent):
        raise ValueError("Train LoRA has no data: connect dataset (Image+Caption Dataset), or latent (VAE Encode) "
                         "and conditioning (CLIP Text Encode)")
    return "dataset" if dataset else "latent"


class TrainLoRA:
    """Runs the training steps on a copy of the model (the loaded model is never changed)."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "train", (RUN,), ("run",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL, _tip("From Load Diffusion Model.")),
                "schedule": (SCHEDULE, _tip("From Gradient Checkpointing Schedule.")),
                "steps": ("INT", _tip(HELP["steps"], default=20, min=1, max=1_000_000)),
                "learning_rate": ("FLOAT", _tip(HELP["learning_rate"], default=1e-3, min=1e-7, max=1.0, step=1e-5)),
                "lr_scheduler": (list(LR_SCHEDULERS), _tip(HELP["lr_scheduler"])),
                "batch_size": ("INT", _tip(HELP["batch_size"], default=1, min=1, max=1024)),
                "gradient_accumulation_steps": ("INT", _tip(HELP["gradient_accumulation_steps"], default=1, min=1, max=1024)),
                "seed": ("INT", _tip(HELP["seed"], default=0, min=0, max=2**31 - 1)),
                "run_name": ("STRING", _tip("Name of the run: each queue trains into a new folder output/segckpt/"
                                             "<run_name>_00001, _00002, ...", default="lora_run")),
                "resume": ("BOOLEAN", _tip("Continue the latest run of this name from its saved state (the "
                                           "options that shape the run must match it; steps may grow).",
                                           default=False)),
            },
            "optional": {
                "dataset": (DATASET, _tip("From Image+Caption Dataset; or connect latent and conditioning instead "
                                          "(one data source).")),
                "latent": ("LATENT", _tip("Instead of dataset: the training images' latents from VAE Encode (a "
                                          "batch), encoded with this model's VAE; used with conditioning.")),
                "conditioning": ("CONDITIONING", _tip(
                    "With latent: from CLIP Text Encode, one conditioning for all images, or one entry per image "
                    "in the latents' order (as ComfyUI's own Train LoRA). Families without a ComfyUI latent "
                    "mapping are refused when the run starts.")),
                "offload": (OFFLOAD, _tip("Optional: overrides the schedule's backend and offload keys.")),
                "lora_config": (LORA_CONFIG, _tip("Optional: default rank 16, alpha 16.")),
                "guardrails": (GUARDRAILS, _tip("Optional, from Fit Guardrails: a pre-flight memory verdict before "
                                                "step 1, out-of-memory recovery, the slowdown watchdog.")),
                "attention_backend": ("STRING", _tip(HELP["attention_backend"], default="auto")),
                "on_nonfinite": (list(NONFINITE_POLICIES), _tip(HELP["on_nonfinite"], default="stop")),
                "preview_every": ("INT", _tip(HELP["validation_every"] + " Shown on this node while it trains; with "
                                              "latent + conditioning, connect the VAE that encoded them.",
                                              default=0, min=0, max=1_000_000)),
                "vae": ("VAE", _tip("Optional: decodes the previews of a run on ComfyUI latents (the VAE of VAE "
                                    "Encode).")),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, run_name, attention_backend="auto", dataset=UNLINKED, latent=UNLINKED,
                        conditioning=UNLINKED):
        # ComfyUI passes None for a linked input named here (its value is not known yet) and leaves
        # an unconnected optional input out, so which data inputs are connected is known at /prompt.
        # The model's family is not (it is another node's widget): a family without a ComfyUI
        # latent mapping is refused when the run starts, before any work. Raised, not returned:
        # ComfyUI lists a returned message once per input named here.
        try:
            contained(current_host().output_dir / "segckpt", run_name, "run_name")
            parse_attention_backend(attention_backend)
            data_source(dataset is not UNLINKED, latent is not UNLINKED, conditioning is not UNLINKED)
        except (PathError, AttentionBackendError, ValueError) as exc:
            raise NodeError(current_host().public(str(exc))) from None
        return True

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Every queue trains a new run (ComfyUI would otherwise reuse the cached result of an
        unchanged graph): NaN never equals the previous value."""
        return float("nan")

    @staticmethod
    def check_inputs(steps, learning_rate, lr_scheduler, batch_size, gradient_accumulation_steps, seed, run_name,
                     resume, attention_backend="auto", on_nonfinite="stop", preview_every=0) -> TrainConfig:
        """The engine config of the node's own inputs (the model, data and schedule come later).

        Raises:
            ConfigError, AttentionBackendError, PathError: an input is invalid (named).
        """
        root = current_host().output_dir / "segckpt"
        if resume:  # the latest run of that name; a new queue otherwise starts run_name_<next number>
            output = latest_run(root, run_name)
            if output is None:
                raise ConfigError(f"resume=true: there is no run {run_name!r} to continue under output/segckpt; "
                                  "allowed: resume off (starts a new numbered run), or the run_name of an existing run")
        else:
            output = numbered_run(root, run_name)
        return TrainConfig(steps=steps, learning_rate=learning_rate, lr_scheduler=lr_scheduler,
                           batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
                           seed=seed, resume=resume, attention_backend=attention_backend,
                           on_nonfinite=on_nonfinite, validation_every=preview_every, output=str(output))

    @public_errors
    def train(self, model, dataset=None, schedule=None, steps=20, learning_rate=1e-3, lr_scheduler="constant",
              batch_size=1, gradient_accumulation_steps=1, seed=0, run_name="lora_run", resume=False, offload=None,
              lora_config=None, attention_backend="auto", on_nonfinite="stop", unique_id=None, latent=None,
              conditioning=None, preview_every=0, vae=None, guardrails=None):
        host = current_host()
        comfy_data = data_source(dataset is not None, latent is not None, conditioning is not None) == "latent"
        family = model.family.name
        if schedule["family"] != family:
            raise ValueError(f"schedule is for family {schedule['family']!r} but the model is {family!r}: "
                             "set the Gradient Checkpointing Schedule node's family to the model's")
        schedule = schedule["schedule"]
        if offload:
            schedule = schedule.replace(**offload)
        check_supported(model.family, schedule)  # the offload node may ask for a backend the family lacks
        config = dataclasses.replace(
            self.check_inputs(steps, learning_rate, lr_scheduler, batch_size, gradient_accumulation_steps, seed,
                              run_name, resume, attention_backend, on_nonfinite, preview_every),
            family=family, schedule=schedule, lora=lora_config or LoraSettings(),
            base_model_precision=model.base_precision or "auto", **(guardrails or {}))
        prepared = previews = None
        if comfy_data:  # the engine maps them (a family without a ComfyUI latent mapping stops here)
            prepared = prepare_comfy_data(model.family, model.family.text(model.transformer.config), latent,
                                          conditioning)
            previews = _comfy_previews(model.family, prepared, vae) if preview_every and vae is not None else None
        else:
            config = dataclasses.replace(config, data=dataset["data"], resolution=dataset["resolution"],
                                         buckets=dataset.get("buckets", False))
        update = host.progress(unique_id, steps)
        run_folder = Path(config.output).resolve().relative_to(host.output_dir.resolve()).as_posix()

        notes: list[str] = []

        def note(lines: list[str]) -> None:  # the verdict, switches and watchdog, drawn on this node
            notes.extend(host.public(line) for line in lines)
            host.send("segckpt.notes", {"node": unique_id, "lines": list(notes)})

        def on_step(record, total):
            update(record.step)
            note([f"step {s['step']}: out of memory under {s['from']}: switched to {s['to']}"
                  for s in record.schedule_switches] + [found["message"] for found in record.watchdog])
            host.send("segckpt.loss", {"node": unique_id, "step": record.step, "total": total,
                                       "loss": record.loss})
            if record.previews:  # drawn on this node while it trains (web/train_loss_curve.js)
                host.send("segckpt.preview", {"node": unique_id, "step": record.step, "images": [
                    {"filename": Path(p).name, "subfolder": f"{run_folder}/{Path(p).parent.as_posix()}",
                     "type": "output"} for p in record.previews]})

        with torch.inference_mode(False):  # our copy: the loaded model is shared with other nodes
            bundle = dataclasses.replace(model, transformer=copy.deepcopy(model.transformer))
        # one latent cache for every run of this server: its keys are the data, the model and the
        # resolution, so queueing again (or changing a training setting) does not encode again
        result = guarded_train(config, bundle=bundle, on_step=on_step, should_stop=host.interrupted,
                               cache_dir=host.output_dir / "segckpt" / "cache", prepared=prepared,
                               preview_source=previews, on_verdict=lambda v: note(v.render().splitlines()))
        return ({"result": result, "lora": result.config.lora},)


def _comfy_previews(family, prepared, vae) -> PreviewSource:
    """Previews of a run on ComfyUI latents: the first conditioning's text, decoded by ComfyUI's VAE
    (``VAE.decode`` takes raw latents and gives ``(B, H, W, 3)`` in [0, 1])."""
    fmt = comfy_latent_format(family)
    cache = prepared.cache
    text = TextBatch(cache["text_seq"][:1], cache["text_mask"][:1],
                     cache["text_pooled"][:1] if "text_pooled" in cache else None)

    def decode(latents: torch.Tensor) -> torch.Tensor:
        return vae.decode(fmt.process_out(latents)).movedim(-1, 1).float().clamp(0, 1).cpu()

    return PreviewSource(text, decode, sample_latent_shape(cache), ["conditioning0"])


class AnyType(str):
    """A type that matches any input (ComfyUI compares types with ``!=``): lets Save LoRA's file name
    feed a LoRA loader's ``lora_name``, so the file trained in this graph is the one applied."""

    def __ne__(self, other: object) -> bool:
        return False


class SaveLoRA:
    """Writes the trained LoRA into ``models/loras`` as ``<prefix>_00001.safetensors``, ``_00002``, ...
    (never over an earlier file); it loads in ComfyUI's LoRA loaders and diffusers, and its
    ``lora_name`` output can feed ``LoraLoaderModelOnly`` in the same graph."""

    CATEGORY, FUNCTION, OUTPUT_NODE = CATEGORY, "save", True
    RETURN_TYPES, RETURN_NAMES = (AnyType("*"),), ("lora_name",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "run": (RUN, _tip("From Train LoRA.")),
            "filename_prefix": ("STRING", _tip("File name under models/loras (no '..', no absolute path); a number "
                                               "is added: prefix_00001.safetensors, ...", default="segckpt_lora")),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, filename_prefix):
        try:
            contained(current_host().loras_dir, filename_prefix, "filename_prefix")
        except PathError as exc:
            return current_host().public(str(exc))
        return True

    @public_errors
    def save(self, run, filename_prefix):
        host = current_host()
        result = run["result"]
        path = next_file(host.loras_dir, filename_prefix, ".safetensors", "filename_prefix")
        meta = {"family": result.plan.family, "schedule": result.config.schedule.to_dict(),
                "steps": len(result.history)}
        save_lora(result.model, path, run["lora"], meta)
        name = path.relative_to(host.loras_dir.resolve()).as_posix()
        return {"ui": {"text": [f"saved models/loras/{name} ({len(result.history)} steps, "
                                f"rank {run['lora'].rank}, alpha {run['lora'].alpha:g})"]}, "result": (name,)}
