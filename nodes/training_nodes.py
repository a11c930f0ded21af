"""Train LoRA and Save LoRA: the node that runs the training steps and the one that keeps its LoRA.

Train LoRA converts its inputs to one engine config (:func:`run_config`), its data to the
engine's (an Image+Caption Dataset, or ComfyUI's LATENT + CONDITIONING), calls the facade's
``train`` on its own copy of the model (:meth:`~.payloads.ModelSource.load`) and hands the
``TrainResult`` on, holding the LoRA but not the model; what it shows while training
(progress, loss, previews, the guardrails' notes) goes through :class:`~.live.LiveRun`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..engine import api
from . import messages
from .environment import (
    PathError,
    contained,
    current_host,
    latest_run,
    next_file,
    node_error,
    numbered_run,
    public_errors,
)
from .live import LiveRun
from .payloads import CATEGORY, ModelSource, Sockets
from .v3 import io
from .widgets import NodeOptions, widget

OPTIONS = NodeOptions({"steps": "steps", "learning_rate": "learning_rate", "lr_scheduler": "lr_scheduler",
                       "batch_size": "batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
                       "seed": "seed", "attention_backend": "attention_backend", "on_nonfinite": "on_nonfinite",
                       "preview_every": "validation_every", "compile_blocks": "compile_blocks",
                       "optimizer": "optimizer", "max_grad_norm": "max_grad_norm"})
"""Train LoRA's widgets that are engine options (``preview_every`` is ``validation_every``)."""
messages.register({"run_name": "output"})  # the node's run_name makes the engine's output folder


def data_source(dataset: bool, latent: bool, conditioning: bool, images: bool = False) -> str:
    """Which data Train LoRA trains on: ``dataset``, ``latent`` (with conditioning) or ``images``
    (an IMAGE batch with its caption).

    Raises:
        ValueError: several sources, none, or latent without conditioning (or the reverse),
            naming the node's inputs.
    """
    if sum((dataset, latent or conditioning, images)) > 1:
        given = [name for name, on in (("dataset", dataset), ("latent + conditioning", latent or conditioning),
                                       ("images", images)) if on]
        raise ValueError(f"Train LoRA takes one data source: dataset, latent + conditioning, or images (+ caption); "
                         f"{' and '.join(given)} are connected: disconnect all but one")
    if latent != conditioning:
        have, need = ("latent", "conditioning") if latent else ("conditioning", "latent")
        raise ValueError(f"Train LoRA input {have} is connected without {need}: connect {need} too (or use dataset)")
    if not (dataset or latent or images):
        raise ValueError("Train LoRA has no data: connect dataset (Image+Caption Dataset), latent (VAE Encode) "
                         "and conditioning (CLIP Text Encode), or images (Load Video -> Get Video Components, "
                         "Load Image) with a caption")
    return "dataset" if dataset else "latent" if latent else "images"


def run_folder(run_name: str, resume: bool) -> Path:
    """The run's folder under ``output/segckpt``: a new numbered one, or with ``resume`` the latest
    run of that name.

    Raises:
        PathError: ``run_name`` leaves the folder. ConfigError: nothing to resume.
    """
    root = current_host().output_dir / "segckpt"
    if not resume:  # each queue starts run_name_<next number>
        return numbered_run(root, run_name)
    output = latest_run(root, run_name)
    if output is None:
        raise api.ConfigError(f"resume=true: there is no run {run_name!r} to continue under output/segckpt; "
                              "allowed: resume off (starts a new numbered run), or the run_name of an existing run")
    return output


def run_config(inputs: dict[str, Any], model: ModelSource | None = None, schedule=None,
               find_run: bool = True) -> api.TrainConfig:
    """The engine config of Train LoRA's inputs: its widgets, the connected LoRA config, noise
    schedule, offload options, weight-offload options, guardrails and dataset (its folder, size,
    frames and caption dropout), and the model's family and base precision; the optimizer's package
    must be installed (refused here, before the model loads).

    The schedule's keys are overridden by the activation offload options' (``offload``), then by the
    weight offload options' (``weight_offload``).

    Args:
        find_run: look up the run folder (with ``resume``, the latest run of the name must exist);
            ``False`` (the prompt's validation): only check that the name stays inside the folder.

    Raises:
        ConfigError, ScheduleError, PathError: an input is invalid (named); ``optimizer``'s package
            is not installed.
    """
    guardrails = inputs.get("guardrails") or api.GuardrailsConfig()
    nonfinite = inputs.get("on_nonfinite")
    components: dict[str, Any] = {"lora": inputs.get("lora_config") or api.LoraSettings(),
                                  "objective": inputs.get("noise_schedule") or api.ObjectiveConfig(),
                                  "guardrails": dataclasses.replace(guardrails, on_nonfinite=nonfinite or "stop"),
                                  "resume": inputs.get("resume", False)}
    if "run_name" in inputs and find_run:
        components["output"] = str(run_folder(inputs["run_name"], components["resume"]))
    elif "run_name" in inputs:  # a run to resume is looked up when the node runs
        contained(current_host().output_dir / "segckpt", inputs["run_name"], "run_name")
    if isinstance(inputs.get("dataset"), api.DataConfig):
        data = inputs["dataset"]
        components |= {"data": data.folder, "resolution": data.resolution, "buckets": data.buckets,
                       **{key: getattr(data, key) for key in ("caption_dropout",) + api.FRAME_KEYS}}
    if model is not None:
        components |= {"family": model.family.name, "base_model_precision": model.base_precision or "auto"}
    if schedule is not None:
        chosen = schedule.schedule
        for override in (inputs.get("offload"), inputs.get("weight_offload")):  # in this order
            chosen = override.apply(chosen) if override else chosen
        components["schedule"] = chosen
    config = OPTIONS.config({k: v for k, v in inputs.items() if k != "on_nonfinite"}, **components)
    api.check_optimizer(config.optimizer, config.model)  # a missing package: refused when queued, not after the model loads
    return config


class TrainLoRA(io.ComfyNode):
    """Runs the training steps on its own copy of the model (loaded for the run, released after it)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptTrainLoRA", display_name="Train LoRA (gradient checkpointing)",
                         category=CATEGORY, inputs=_train_inputs(), outputs=[Sockets.run.Output(display_name="run")],
                         hidden=[io.Hidden.unique_id])

    @classmethod
    def validate_inputs(cls, **inputs):
        # ComfyUI passes None for a linked input (its value is not known yet) and leaves an
        # unconnected optional input out, so which data inputs are connected is known at /prompt.
        # The model's family is not (it is another node's widget): a family without a ComfyUI
        # latent mapping is refused when the run starts, before any work. Raised, not returned:
        # ComfyUI lists a returned message once per input.
        try:
            run_config({k: v for k, v in inputs.items() if v is not None}, find_run=False)
            data_source("dataset" in inputs, "latent" in inputs, "conditioning" in inputs, "images" in inputs)
        except (PathError, ValueError) as exc:
            raise node_error(exc) from None
        return True

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        """Every queue trains a new run (ComfyUI would otherwise reuse the cached result of an
        unchanged graph): NaN never equals the previous value."""
        return float("nan")

    @staticmethod
    def check_inputs(**inputs) -> api.TrainConfig:
        """The engine config of the node's own widget values (the model, data and schedule come
        later; linked inputs are ``None``).

        Raises:
            ConfigError, AttentionBackendError, PathError: an input is invalid (named).
        """
        return run_config({k: v for k, v in inputs.items() if v is not None}, find_run=False)

    @classmethod
    @public_errors
    def execute(cls, model, schedule, **inputs):
        if schedule.family != model.family.name:
            raise ValueError(f"schedule is for family {schedule.family!r} but the model is {model.family.name!r}: "
                             "set the Gradient Checkpointing Schedule node's family to the model's")
        source = data_source(inputs.get("dataset") is not None, inputs.get("latent") is not None,
                             inputs.get("conditioning") is not None, inputs.get("images") is not None)
        config = run_config(inputs, model, schedule)
        host = current_host()
        released = host.release_models()  # ComfyUI's own models leave the device before this run loads
        bundle = model.load()  # this run's own copy, released when the node returns
        prepared = previews = None
        if source == "images":  # encoded here, by the graph's VAE when connected, else the model's
            with torch.inference_mode(False):
                encode = api.batch_encoder(bundle.family, bundle.vae, inputs.get("vae"))
                multiple = api.image_batch_multiple(bundle.family, bundle.transformer.config, bundle.vae,
                                                    inputs.get("vae"))
                prepared = api.prepare_image_batch(bundle.family, inputs["images"], inputs.get("caption") or "",
                                                   config.data, encode, bundle.encode_text, multiple)
        if source == "latent":  # the engine maps them (a family without a ComfyUI latent mapping stops here)
            prepared = api.prepare_comfy_data(bundle.family, bundle.family.text(bundle.transformer.config),
                                              inputs["latent"], inputs["conditioning"])
            if config.validation.validation_every and inputs.get("vae") is not None:
                previews = api.comfy_preview_source(bundle.family, prepared, inputs["vae"],
                                                    config.validation.validation_frames,
                                                    config.data.frame_rate)
        live = LiveRun(host, cls.hidden.unique_id, config)
        if released:  # what ComfyUI unloaded: on the console and on the node
            for line in released:
                live.log(line)
            live.note(released)
        unused = api.unused_keys(config.schedule) if inputs.get("offload") is not None else []
        if unused:  # e.g. unsloth over the planner's `none`: say that it does nothing
            live.note([f"Activation Offload Options: {note}" for note in unused])
        # one latent cache for every run of this server: its keys are the data, the model and the
        # resolution, so queueing again (or changing a training setting) does not encode again
        result = api.train(config, bundle=bundle, on_step=live.on_step, should_stop=live.host.interrupted,
                           cache_dir=live.host.output_dir / "segckpt" / "cache", prepared=prepared,
                           preview_source=previews, on_verdict=live.on_verdict, on_preflight=live.on_preflight,
                           log=live.log)
        if result.interrupted:
            live.note([f"cancelled after step {len(result.history)} of {config.steps}: the state is saved; queue "
                       "again with resume on (same run_name) to continue"])
        elif result.trained_steps == 0:
            live.note([f"0 steps trained: the run already had {len(result.history)} of {config.steps} steps "
                       "(raise steps to continue it)"])
        # ComfyUI keeps node outputs in its cache: hand on the LoRA, not the trained model copy (its
        # frozen weights, the runner and its host buffers are released here)
        return io.NodeOutput(result.without_model())


class SaveLoRA(io.ComfyNode):
    """Writes the trained LoRA into ``models/loras`` as ``<prefix>_00001.safetensors``, ``_00002``, ...
    (never over an earlier file). Its default ``lora_format`` (``comfyui``) writes the family's
    released-layout names, which ComfyUI's own ``LoraLoaderModelOnly`` applies with every key, so the
    ``lora_name`` output can feed that loader in the same graph; ``diffusers`` writes diffusers'
    names, ``both`` the two files (``lora_name`` then names the ComfyUI one)."""

    @classmethod
    def define_schema(cls):
        # the output's type "*" matches any input: the file name feeds a LoRA loader's lora_name
        return io.Schema(node_id="SegCkptSaveLoRA", display_name="Save LoRA", category=CATEGORY, is_output_node=True,
                         inputs=[Sockets.run.Input("run", tooltip="From Train LoRA."),
                                 io.String.Input("filename_prefix", default="segckpt_lora", tooltip=(
                                     "File name under models/loras (no '..', no absolute path); a number is added: "
                                     "prefix_00001.safetensors, ...")),
                                 widget("lora_format", optional=True, default="comfyui", tooltip=(
                                     "comfyui: the names this graph's LoraLoaderModelOnly applies (the family's "
                                     "released layout); diffusers: transformer.* names for diffusers' "
                                     "load_lora_weights; both: the two files (the diffusers one as "
                                     "<name>_diffusers.safetensors)."))],
                         outputs=[io.AnyType.Output(display_name="lora_name")])

    @classmethod
    def validate_inputs(cls, filename_prefix):
        try:  # raised, as every node's refusal (``routes.name_inputs`` names the input)
            contained(current_host().loras_dir, filename_prefix, "filename_prefix")
        except PathError as exc:
            raise node_error(exc) from None
        return True

    @classmethod
    @public_errors
    def execute(cls, run, filename_prefix, lora_format="comfyui"):
        """Write the files; ``lora_name`` is the ComfyUI one's (the only one's) name under models/loras.

        Raises:
            ValueError: ``comfyui`` for a family without a released layout (named).
        """
        host = current_host()
        path = next_file(host.loras_dir, filename_prefix, ".safetensors", "filename_prefix")
        lora, family = run.config.lora, run.plan.family
        meta = {"schedule": run.config.schedule.to_dict(), "steps": len(run.history)}
        # the graph's loader takes the ComfyUI file: with both, it keeps the plain name
        files = api.save_lora_files(run.lora_source, path, lora, family, lora_format, meta, primary="comfyui")
        path = files.get("comfyui", files.get("diffusers"))
        same = _same_earlier_file(path, filename_prefix) if run.trained_steps == 0 else None
        if same is not None:  # a resume with nothing left: the earlier file is this LoRA
            for written in files.values():
                written.unlink()
            path = same
        name = path.relative_to(host.loras_dir.resolve()).as_posix()
        fmt = lora_format if len(files) == 1 else "comfyui"
        steps = f"{len(run.history)} steps, rank {lora.rank}, alpha {lora.alpha:g}"
        if same is not None:
            text = (f"unchanged: models/loras/{name} ({steps}); this run trained 0 steps (it resumed at step "
                    f"{run.resumed_at} of {run.config.steps}: nothing left), so no new file was written")
        else:
            extra = "".join(f", {kind}: {p.name}" for kind, p in files.items() if p != path)
            trained = f"; 0 trained in this run (nothing left after step {run.resumed_at})" if run.trained_steps == 0 else ""
            text = f"saved models/loras/{name} ({fmt}; {steps}{trained}{extra})"
        return io.NodeOutput(name, ui={"text": [text]})


def _same_earlier_file(path: Path, prefix: str) -> Path | None:
    """The latest other ``<prefix>_NNNNN.safetensors`` beside ``path`` holding the same LoRA, if any."""
    stem = Path(prefix).name
    earlier = sorted((p for p in path.parent.glob(f"{stem}_*.safetensors")
                      if p != path and p.name[len(stem) + 1:-len(".safetensors")].isdigit()), reverse=True)
    try:
        return earlier[0] if earlier and api.same_safetensors(earlier[0], path) else None
    except ValueError:  # a damaged earlier file is not this LoRA
        return None


def _train_inputs() -> list:
    """Train LoRA's inputs: required, then optional, each in the order saved workflows' widget values
    follow (new ones last)."""
    return [
        Sockets.model.Input("model", tooltip="From Load Diffusion Model."),
        Sockets.schedule.Input("schedule", tooltip="From Gradient Checkpointing Schedule."),
        *[widget(name) for name in ("steps", "learning_rate", "lr_scheduler", "batch_size",
                                    "gradient_accumulation_steps", "seed")],
        io.String.Input("run_name", default="lora_run", tooltip="Name of the run: each queue trains into a new folder "
                        "output/segckpt/<run_name>_00001, _00002, ..."),
        widget("resume", tooltip="Continue the latest run of this name from its saved state (the options that shape "
               "the run must match it; steps may grow)."),
        Sockets.dataset.Input("dataset", optional=True, tooltip="From Image+Caption Dataset; or connect latent and "
                              "conditioning instead (one data source)."),
        io.Latent.Input("latent", optional=True, tooltip="Instead of dataset: the training images' latents from VAE "
                        "Encode (a batch), encoded with this model's VAE; used with conditioning."),
        io.Conditioning.Input("conditioning", optional=True, tooltip=(
            "With latent: from CLIP Text Encode, one conditioning for all images, or one entry per image in the "
            "latents' order (as ComfyUI's own Train LoRA). Families without a ComfyUI latent mapping are refused "
            "when the run starts.")),
        io.Image.Input("images", optional=True, tooltip=(
            "Instead of dataset: a clip's frames (Load Video -> Get Video Components, Video Helper Suite) for a video "
            "family, trained as one clip of the most frames its rule allows (Wan: 4k+1); or images for an image "
            "family. Trained at their own size, cropped to the model's pixel multiple; encoded with the vae input, "
            "else the model's own VAE.")),
        io.String.Input("caption", optional=True, default="", multiline=True, tooltip="With images: their caption."),
        Sockets.offload.Input("offload", optional=True, tooltip="Optional: overrides the schedule's backend and "
                              "offload keys."),
        Sockets.weight_offload.Input("weight_offload", optional=True, tooltip=(
            "Optional, from Weight Offload Options: the blocks' frozen weights stay in host memory and stream to the "
            "device before each use (saves device memory, costs copies); overrides the schedule's weight_offload "
            "keys.")),
        Sockets.lora_config.Input("lora_config", optional=True, tooltip="Optional: default rank 16, alpha 16."),
        Sockets.noise_schedule.Input("noise_schedule", optional=True, tooltip=(
            "Optional, from Noise Schedule: timestep sampling, flow shift, loss weighting, guidance; default: "
            "logit-normal noise levels at the family's own inference shift, unweighted, guidance 1.")),
        Sockets.guardrails.Input("guardrails", optional=True, tooltip=(
            "Optional, from Fit Guardrails: a pre-flight memory verdict before step 1, out-of-memory recovery, the "
            "slowdown watchdog.")),
        *[widget(name, optional=True) for name in ("attention_backend", "compile_blocks", "on_nonfinite")],
        widget("validation_every", "preview_every", optional=True, extra=" Shown on this node while it trains; with "
               "latent + conditioning, connect the VAE that encoded them."),
        io.Vae.Input("vae", optional=True, tooltip="Optional: decodes the previews of a run on ComfyUI latents (the VAE "
                     "of VAE Encode)."),
        # after the widgets above: a saved workflow's widgets_values map by position
        widget("optimizer", optional=True),
        widget("max_grad_norm", optional=True),
    ]
