"""The nodes that make a run's inputs: Load Diffusion Model, Image+Caption Dataset, LoRA Config."""

from __future__ import annotations

from ..engine import api
from .environment import (
    BUILTIN_CLIP,
    BUILTIN_DATA,
    TINY_PRESET,
    PathError,
    contained,
    current_host,
    model_files,
    model_folders,
    node_error,
    public_errors,
    resolve_model,
)
from .payloads import CATEGORY, ModelSource, Sockets
from .v3 import io
from .widgets import NodeOptions, widget


class LoadDiffusionModel(io.ComfyNode):
    """A diffusers folder under ``models/diffusers``, one ``.safetensors`` file under
    ``models/diffusion_models``, ``models/unet`` or ``models/checkpoints`` or one ``.gguf`` file under
    the first two (shown as ``diffusion_models/<file>``, ``checkpoints/<file>``), or the family's tiny
    random-init preset."""

    OPTIONS = NodeOptions({"family": "family", "seed": "seed", "base_model_precision": "base_model_precision"})

    @classmethod
    def define_schema(cls):
        host = current_host()
        return io.Schema(node_id="SegCkptLoadDiffusionModel", display_name="Load Diffusion Model (gradient checkpointing)",
                         category=CATEGORY, inputs=[
                             widget("family"),
                             io.Combo.Input("source", options=[TINY_PRESET] + model_folders(host) + model_files(host),
                                            tooltip="A diffusers folder under models/diffusers; a .safetensors file "
                                            "under models/diffusion_models, unet or checkpoints, or a .gguf file under "
                                            "diffusion_models or unet (original release or diffusers layout; scaled "
                                            "fp8 and GGUF files load as a quantized base; the variant is read from its "
                                            "shapes; training then needs a VAE, which a single file does not hold); or "
                                            "the tiny random-init preset."),
                             widget("seed", tooltip="Seed of the preset's random init."),
                             widget("base_model_precision")],
                         outputs=[Sockets.model.Output(display_name="model")])

    @classmethod
    def validate_inputs(cls, source, **inputs):
        try:
            if source is not None and source != TINY_PRESET:
                resolve_model(current_host(), source)
            cls.OPTIONS.config(inputs)
        except ValueError as exc:  # PathError, ConfigError: raised, so that ComfyUI lists it once
            raise node_error(exc) from None
        return True

    @classmethod
    @public_errors
    def execute(cls, family, source, seed, base_model_precision="auto"):
        # the model is read by each node that uses it (ModelSource.load), not here: a server keeps
        # node outputs, and would keep the model; its family is checked here (the config or the
        # tensor names, no weights read), so a wrong file is refused on this node
        path = None if source == TINY_PRESET else resolve_model(current_host(), source)
        where = {} if path is None else {"model_file": str(path)} if path.is_file() else {"model_path": str(path)}
        config = api.TrainConfig.create(family=family, seed=seed, base_model_precision=base_model_precision, **where)
        found = api.model_family(config.model.model_path, config.model.model_file)
        if found is not None and found != config.model.family:
            raise ValueError(f"family={family!r} is invalid for source={source!r}: it holds a {found} model; "
                             f"set family to {found}")
        return io.NodeOutput(ModelSource(config))


class ImageCaptionDataset(io.ComfyNode):
    """A folder of images and clips (video files, animated GIF / WebP) with same-name ``.txt``
    captions under ComfyUI's input folder, the frame options of the video families and the
    caption dropout."""

    OPTIONS = NodeOptions({name: name for name in ("resolution", "buckets") + api.FRAME_KEYS + ("caption_dropout",)},
                          zero_unset=("frame_rate", "min_frames"))

    @classmethod
    def define_schema(cls):
        unset = cls.OPTIONS.zero_unset
        return io.Schema(node_id="SegCkptImageCaptionDataset", display_name="Image+Caption Dataset", category=CATEGORY,
                         inputs=[io.String.Input("folder", default=BUILTIN_DATA, tooltip=(
                                     f"Folder under ComfyUI's input folder; {BUILTIN_DATA} = photographs shipped with "
                                     f"scikit-image; {BUILTIN_CLIP} = a 33-frame pan across one (for the video "
                                     "families).")),
                                 widget("resolution"), widget("buckets"),
                                 *[widget(name, optional=True, zero_unset=name in unset,
                                          extra=" 0 = unset." if name in unset else "") for name in api.FRAME_KEYS],
                                 # last: saved widgets_values map by position
                                 widget("caption_dropout", optional=True)],
                         outputs=[Sockets.dataset.Output(display_name="dataset")])

    @classmethod
    def validate_inputs(cls, folder, **inputs):
        host = current_host()
        try:
            cls.OPTIONS.config(inputs)
            if folder is not None and folder not in (BUILTIN_DATA, BUILTIN_CLIP):
                path = contained(host.input_dir, folder, "folder")
                if not path.is_dir():  # raised like every refusal: a returned one is listed once per input
                    raise PathError(f"folder={folder!r} is invalid: no such folder under the input folder")
                api.check_dataset(path)  # captions decoded, images read through: refused at /prompt
        except (PathError, ValueError) as exc:
            raise node_error(exc) from None
        return True

    @classmethod
    @public_errors
    def execute(cls, folder, resolution, buckets=False, **options):
        host = current_host()
        if folder == BUILTIN_DATA:  # written once per server and shared by its runs
            path = str(api.write_sample_dataset(host.output_dir / "segckpt" / "sample_data"))
        elif folder == BUILTIN_CLIP:
            path = str(api.write_sample_clip(host.output_dir / "segckpt" / "sample_clip"))
        else:
            path = str(contained(host.input_dir, folder, "folder"))
        return io.NodeOutput(cls.OPTIONS.config({"resolution": resolution, "buckets": buckets, **options}, data=path).data)


class LoRAConfig(io.ComfyNode):
    """The adapter: rank, alpha, dropout, target modules (a preset or names), type, DoRA and LoKr's
    factor (peft)."""

    OPTIONS = NodeOptions({"rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout",
                           "lora_type": "lora_type", "use_dora": "use_dora", "lokr_factor": "lokr_factor",
                           "lokr_full_matrix": "lokr_full_matrix"})

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptLoRAConfig", display_name="LoRA Config", category=CATEGORY,
                         inputs=[widget("lora_rank", "rank"), widget("lora_alpha", "alpha"),
                                 widget("lora_dropout", "dropout"),
                                 widget("lora_target_modules", "target_modules",
                                        extra=" Comma-separated; empty = attention."),
                                 # optional: workflows saved before they existed still validate
                                 *[widget(key, optional=True) for key in ("lora_type", "use_dora", "lokr_factor",
                                                                          "lokr_full_matrix")]],
                         outputs=[Sockets.lora_config.Output(display_name="lora_config")])

    @classmethod
    def validate_inputs(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @classmethod
    @public_errors
    def execute(cls, rank, alpha, dropout, target_modules, lora_type="lora", use_dora=False, lokr_factor=-1,
              lokr_full_matrix=False):
        targets = tuple(t.strip() for t in target_modules.split(",") if t.strip()) or None
        return io.NodeOutput(api.LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets,
                                              lora_type=lora_type, use_dora=use_dora, factor=lokr_factor,
                                              full_matrix=lokr_full_matrix))
