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
from .payloads import CATEGORY, DATASET, LORA_CONFIG, MODEL, ModelSource
from .widgets import NodeOptions, tip, widget


class LoadDiffusionModel:
    """A diffusers folder under ``models/diffusers``, one ``.safetensors`` file under
    ``models/diffusion_models``, ``models/unet`` or ``models/checkpoints`` or one ``.gguf`` file under
    the first two (shown as ``diffusion_models/<file>``, ``checkpoints/<file>``), or the family's tiny
    random-init preset."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "load", (MODEL,), ("model",)
    OPTIONS = NodeOptions({"family": "family", "seed": "seed", "base_model_precision": "base_model_precision"})

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": widget("family"),
            "source": ([TINY_PRESET] + model_folders(current_host()) + model_files(current_host()),
                       tip("A diffusers folder under models/diffusers; a .safetensors file under "
                           "models/diffusion_models, unet or checkpoints, or a .gguf file under diffusion_models or "
                           "unet (original release or diffusers layout; scaled fp8 and GGUF files load as a "
                           "quantized base; the variant is read from its shapes; training then needs a VAE, which "
                           "a single file does not hold); or the tiny random-init preset.")),
            "seed": widget("seed", tooltip="Seed of the preset's random init."),
            "base_model_precision": widget("base_model_precision"),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, source, **inputs):
        try:
            if source is not None and source != TINY_PRESET:
                resolve_model(current_host(), source)
            cls.OPTIONS.config(inputs)
        except ValueError as exc:  # PathError, ConfigError: raised, so that ComfyUI lists it once
            raise node_error(exc) from None
        return True

    @public_errors
    def load(self, family, source, seed, base_model_precision="auto"):
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
        return (ModelSource(config),)


class ImageCaptionDataset:
    """A folder of images and clips (video files, animated GIF / WebP) with same-name ``.txt``
    captions under ComfyUI's input folder, the frame options of the video families and the
    caption dropout."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (DATASET,), ("dataset",)
    OPTIONS = NodeOptions({name: name for name in ("resolution", "buckets") + api.FRAME_KEYS + ("caption_dropout",)},
                          zero_unset=("frame_rate", "min_frames"))

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "folder": ("STRING", tip(f"Folder under ComfyUI's input folder; {BUILTIN_DATA} = photographs "
                                     f"shipped with scikit-image; {BUILTIN_CLIP} = a 33-frame pan across one (for "
                                     "the video families).", default=BUILTIN_DATA)),
            "resolution": widget("resolution"),
            "buckets": widget("buckets"),
        }, "optional": {**{name: widget(name, zero_unset=name in cls.OPTIONS.zero_unset,
                                        extra=" 0 = unset." if name in cls.OPTIONS.zero_unset else "")
                           for name in api.FRAME_KEYS},
                        "caption_dropout": widget("caption_dropout")}}  # last: saved widgets_values map by position

    @classmethod
    def VALIDATE_INPUTS(cls, folder, **inputs):
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

    @public_errors
    def build(self, folder, resolution, buckets=False, **options):
        host = current_host()
        if folder == BUILTIN_DATA:  # written once per server and shared by its runs
            path = str(api.write_sample_dataset(host.output_dir / "segckpt" / "sample_data"))
        elif folder == BUILTIN_CLIP:
            path = str(api.write_sample_clip(host.output_dir / "segckpt" / "sample_clip"))
        else:
            path = str(contained(host.input_dir, folder, "folder"))
        return (self.OPTIONS.config({"resolution": resolution, "buckets": buckets, **options}, data=path).data,)


class LoRAConfig:
    """The adapter: rank, alpha, dropout, target modules (a preset or names), type, DoRA and LoKr's
    factor (peft)."""

    CATEGORY, FUNCTION, RETURN_TYPES, RETURN_NAMES = CATEGORY, "build", (LORA_CONFIG,), ("lora_config",)
    OPTIONS = NodeOptions({"rank": "lora_rank", "alpha": "lora_alpha", "dropout": "lora_dropout",
                           "lora_type": "lora_type", "use_dora": "use_dora", "lokr_factor": "lokr_factor",
                           "lokr_full_matrix": "lokr_full_matrix"})

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "rank": widget("lora_rank"),
            "alpha": widget("lora_alpha"),
            "dropout": widget("lora_dropout"),
            "target_modules": widget("lora_target_modules", extra=" Comma-separated; empty = attention."),
        }, "optional": {  # optional: workflows saved before they existed still validate
            "lora_type": widget("lora_type"),
            "use_dora": widget("use_dora"),
            "lokr_factor": widget("lokr_factor"),
            "lokr_full_matrix": widget("lokr_full_matrix"),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @public_errors
    def build(self, rank, alpha, dropout, target_modules, lora_type="lora", use_dora=False, lokr_factor=-1,
              lokr_full_matrix=False):
        targets = tuple(t.strip() for t in target_modules.split(",") if t.strip()) or None
        return (api.LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets, lora_type=lora_type,
                                 use_dora=use_dora, factor=lokr_factor,
                                 full_matrix=lokr_full_matrix),)
