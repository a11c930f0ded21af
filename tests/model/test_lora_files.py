"""LoRA files: a saved LoRA changes a fresh base model exactly as the trained adapter did, read by
diffusers' own loaders and by ComfyUI's LoRA key mapping and scale rule.

Every family trains a rank-4, alpha-8 adapter (scale 2 in peft) with non-zero ``lora_B``; the
forward of the trained adapter is the oracle (fp32, same inputs, same seed), to 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging

import diffusers
import pytest
import torch
from diffusers.loaders.lora_base import LoraBaseMixin
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from helpers import random_batch
from peft import LoHaConfig, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from segmented_checkpointing.engine.config import ConfigError, LoraConfigError, LoraSettings
from segmented_checkpointing.engine.families import family_names, get_family
from segmented_checkpointing.engine.files.checks import safetensors_header
from segmented_checkpointing.engine.model.adapters import adapter_layers
from segmented_checkpointing.engine.model.lora_files import add_lora, lora_state_dict, save_lora
from segmented_checkpointing.engine.model.lora_header import check_init_lora, check_not_a_lora

TOL = 1e-5
SETTINGS = LoraSettings(rank=4, alpha=8, init="gaussian")

# The pipeline whose LoRA loader (a diffusers ``*LoraLoaderMixin``) reads each family's transformer.
PIPELINES = {
    "acestep": "AceStepPipeline", "auraflow": "AuraFlowPipeline", "chroma": "ChromaPipeline",
    "cosmos": "Cosmos2_5_PredictBasePipeline", "ernieimage": "ErnieImagePipeline", "flux": "FluxPipeline",
    "flux2": "Flux2Pipeline", "hidream": "HiDreamImagePipeline", "hunyuanvideo": "HunyuanVideoPipeline",
    "ideogram4": "Ideogram4Pipeline", "kandinsky5": "Kandinsky5T2VPipeline", "krea2": "Krea2Pipeline",
    "ltx2video": "LTX2Pipeline", "ltxvideo": "LTXPipeline", "lumina2": "Lumina2Pipeline",
    "qwenimage": "QwenImagePipeline", "qwenimage21": "QwenImage21Pipeline", "sana": "SanaPipeline",
    "sanavideo": "SanaVideoPipeline", "sd3": "StableDiffusion3Pipeline", "wan": "WanPipeline",
    "wanvace": "WanVACEPipeline", "zimage": "ZImagePipeline",
}
# Families diffusers 0.42 cannot load a LoRA file into (the ComfyUI-rule test still covers them).
NO_DIFFUSERS_LOADER = {
    "flux3": "no pipeline for Flux3Transformer2DModel has a LoRA loader mixin",
    "hunyuanvideo15": "HunyuanVideo15Pipeline has no LoRA loader mixin",
    "longcatimage": "LongCatImagePipeline has no LoRA loader mixin",
    "minimaxh3": "no pipeline for MiniMaxH3Transformer3DModel has a LoRA loader mixin",
    "omnigen": "OmniGenPipeline has no LoRA loader mixin",
    "pixart": "PixArtAlphaPipeline / PixArtSigmaPipeline have no LoRA loader mixin",
    "stablecascade": "the StableCascade pipelines have no LoRA loader mixin",
    "unet2dcondition": "StableDiffusionLoraLoaderMixin loads the `unet.` component, not `transformer.` keys",
}


def test_every_family_is_triaged():
    assert not set(PIPELINES) & set(NO_DIFFUSERS_LOADER)
    assert set(PIPELINES) | set(NO_DIFFUSERS_LOADER) == set(family_names())


def _forward(family, model, batch) -> torch.Tensor:
    latents, sigmas, text = batch
    torch.manual_seed(123)  # some families draw noise in make_inputs (LTX-2's audio stream)
    with torch.no_grad():
        return family.read_output(model, model(**family.make_inputs(model, latents, sigmas, text)), latents)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name, settings)`` -> (family, fresh base copy, batch, output with the trained adapter,
    base output, saved LoRA file); built once per argument pair."""
    cache: dict = {}

    def build(name: str, settings: LoraSettings = SETTINGS):
        if (name, settings) not in cache:
            family = get_family(name)
            torch.manual_seed(0)
            base = family.model_cls()(**family.tiny_config).float()
            model = copy.deepcopy(base)
            add_lora(model, settings, family.lora_targets, family)
            with torch.no_grad():
                for key, p in model.named_parameters():
                    if p.requires_grad and not p.any():  # LoRA's B, LoKr's w1, LoHa's w2_b start at zero
                        p.normal_(0, 0.05)
            batch = random_batch(family, model)
            path = tmp_path_factory.mktemp(name) / "lora.safetensors"
            save_lora(model, path, settings, {"family": name})
            cache[name, settings] = (family, base, batch, _forward(family, model, batch),
                                     _forward(family, base, batch), path)
        family, base, batch, want, plain, path = cache[name, settings]
        return family, copy.deepcopy(base), batch, want, plain, path

    return build


def _pipeline(name: str, transformer: torch.nn.Module) -> DiffusionPipeline:
    """The family's diffusers pipeline holding ``transformer`` and no other component.

    Built without the pipeline's own ``__init__``, which needs the text encoders for some families
    (QwenImage21's reads its tokenizer, Cosmos's builds a safety checker): ``load_lora_weights``
    reads only the registered components.
    """
    cls = getattr(diffusers, PIPELINES[name])
    transformer_type = inspect.signature(cls.__init__).parameters["transformer"].annotation
    assert type(transformer).__name__ in str(transformer_type), f"{cls.__name__} holds no {type(transformer)}"
    assert issubclass(cls, LoraBaseMixin) and "transformer" in cls._lora_loadable_modules
    pipe = cls.__new__(cls)
    expected, _ = cls._get_signature_keys(cls)
    pipe.register_modules(**{**dict.fromkeys(expected), "transformer": transformer})
    return pipe


@contextlib.contextmanager
def _diffusers_warnings():
    """Collects the messages of the warnings diffusers logs inside the block."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _check(got, want, plain):
    # not vacuous: the adapter moves the output by > 10 TOL, so a scale off by 2x (ComfyUI without
    # alpha, or alpha applied twice) would miss by about half of that
    assert (want - plain).abs().max() > 10 * TOL
    assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_diffusers_load_lora_weights_matches_trained_adapter(trained, name):
    family, fresh, batch, want, plain, path = trained(name)
    pipe = _pipeline(name, fresh)
    with _diffusers_warnings() as warnings:
        pipe.load_lora_weights(str(path))
    # every key loads (peft_utils._maybe_warn_for_unhandled_keys: "... led to unexpected/missing keys")
    assert not [w for w in warnings if "Loading adapter weights" in w]
    _check(_forward(family, fresh, batch), want, plain)


def comfyui_patch(model: torch.nn.Module, lora: dict[str, torch.Tensor], strength: float = 1.0) -> set[str]:
    """Apply a LoRA to ``model``'s weights the way ComfyUI's LoRA loader does; return the keys it used.

    ComfyUI (``comfy/lora.py``): ``model_lora_keys_unet`` maps the diffusers key
    ``transformer.<module>`` to the model weight of ``<module>``; ``load_lora`` reads
    ``<key>.alpha`` when present; ``LoRAAdapter.load`` (``comfy/weight_adapter/lora.py``) takes
    ``<key>.lora_B.weight`` as up and ``<key>.lora_A.weight`` as down; ``calculate_weight``
    adds ``strength * scale * (up.flatten(1) @ down.flatten(1))`` reshaped to the weight, with
    ``scale = alpha / down.shape[0]`` (the rank), or 1.0 without an ``.alpha`` tensor.
    """
    weights = dict(model.named_parameters())
    used = set()
    for up_key in (k for k in lora if k.endswith(".lora_B.weight")):
        key = up_key[: -len(".lora_B.weight")]
        up, down = lora[up_key], lora[key + ".lora_A.weight"]
        alpha = lora.get(key + ".alpha")
        scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
        weight = weights[key.removeprefix("transformer.") + ".weight"]
        with torch.no_grad():
            weight += (strength * scale) * (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
        used |= {up_key, key + ".lora_A.weight"} | ({key + ".alpha"} if alpha is not None else set())
    return used


@pytest.mark.parametrize("name", family_names())
def test_comfyui_key_mapping_and_scale_match_trained_adapter(trained, name):
    family, fresh, batch, want, plain, path = trained(name)
    lora = load_file(str(path))
    assert comfyui_patch(fresh, lora) == set(lora)  # ComfyUI warns "lora key not loaded" otherwise
    _check(_forward(family, fresh, batch), want, plain)


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_scale_that_is_not_a_power_of_two(trained, name):
    """alpha 6 / rank 4: the folded scale rounds, within the tolerance, on both readers."""
    settings = LoraSettings(rank=4, alpha=6, init="gaussian")
    family, fresh, batch, want, plain, path = trained(name, settings)
    _pipeline(name, fresh).load_lora_weights(str(path))
    _check(_forward(family, fresh, batch), want, plain)
    family, fresh, batch, want, plain, path = trained(name, settings)
    lora = load_file(str(path))
    assert comfyui_patch(fresh, lora) == set(lora)
    _check(_forward(family, fresh, batch), want, plain)


def test_header_carries_diffusers_metadata_as_diffusers_writes_it(tmp_path):
    """Same ``lora_adapter_metadata`` as diffusers' own ``save_lora_weights`` given the adapter's
    ``peft_config.to_dict()`` (what its training scripts pass), except ``lora_alpha``: the file's
    ``lora_B`` carries the scale (2 here), so the config says alpha = rank; the trained settings
    stay in ``lora_settings``."""
    family = get_family("sd3")
    model = family.model_cls()(**family.tiny_config)
    add_lora(model, SETTINGS, family.lora_targets)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.05)
    ours_path = save_lora(model, tmp_path / "ours.safetensors", SETTINGS, {"family": "sd3"})
    diffusers.StableDiffusion3Pipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=lora_state_dict(model), weight_name="theirs.safetensors",
        transformer_lora_adapter_metadata=model.peft_config["default"].to_dict())
    headers = []
    for file in (ours_path, tmp_path / "theirs.safetensors"):
        with safe_open(str(file), "pt") as fh:
            headers.append(fh.metadata())
    ours, theirs = ({k: sorted(v) if isinstance(v, list) else v  # diffusers lists a set unsorted
                     for k, v in json.loads(h["lora_adapter_metadata"]).items()} for h in headers)
    assert theirs["transformer.lora_alpha"] == 8 and theirs["transformer.r"] == 4
    assert ours == {**theirs, "transformer.lora_alpha": 4}
    assert headers[0]["format"] == headers[1]["format"] == "pt"
    assert json.loads(headers[0]["lora_settings"])["alpha"] == 8 and headers[0]["family"] == "sd3"
    ours, theirs = load_file(str(ours_path)), load_file(str(tmp_path / "theirs.safetensors"))
    assert set(ours) == set(theirs)  # same keys: no `.alpha` tensors
    for key, value in theirs.items():
        assert torch.equal(ours[key], 2 * value if ".lora_B." in key else value)


ADAPTER_FILES = {
    "dora": LoraSettings(rank=4, alpha=8, use_dora=True, init="gaussian"),
    "lokr": LoraSettings(rank=4, alpha=8, lora_type="lokr"),
    "lokr_full": LoraSettings(lora_type="lokr", full_matrix=True),
    "loha": LoraSettings(rank=4, alpha=6, lora_type="loha"),
}


@pytest.mark.parametrize("name", ["flux", "sd3", "wan", "zimage"])
@pytest.mark.parametrize("adapter", sorted(ADAPTER_FILES))
def test_adapter_file_is_read_exactly_by_what_reads_its_type(trained, name, adapter):
    """Issue 35. DoRA: diffusers' load_lora_weights (its metadata says use_dora). LoKr: the pipelines'
    load_lora_weights refuse ``lokr`` keys but Z-Image's (and Flux.2's); the transformer's own
    load_lora_adapter reads them for every family. LoHa: diffusers has no loader; peft reads it
    (``LoHaConfig`` from the header's metadata, ``set_peft_model_state_dict``)."""
    family, fresh, batch, want, plain, path = trained(name, ADAPTER_FILES[adapter])
    if adapter == "dora" or adapter.startswith("lokr") and name == "zimage":
        with _diffusers_warnings() as warnings:
            _pipeline(name, fresh).load_lora_weights(str(path))
        assert not [w for w in warnings if "Loading adapter weights" in w]
    elif adapter.startswith("lokr"):
        with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
            _pipeline(name, copy.deepcopy(fresh)).load_lora_weights(str(path))
        fresh.load_lora_adapter(str(path), prefix="transformer")
    else:
        with safe_open(str(path), "pt") as fh:
            metadata = json.loads(fh.metadata()["lora_adapter_metadata"])
        inject_adapter_in_model(LoHaConfig(**{k.removeprefix("transformer."): v for k, v in metadata.items()}), fresh)
        result = set_peft_model_state_dict(fresh, {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()})
        assert not result.unexpected_keys
    _check(_forward(family, fresh, batch), want, plain)


def test_all_linear_adapts_every_linear_of_the_blocks_and_nothing_outside():
    """The ``all-linear`` preset: each ``nn.Linear`` of Flux's double and single blocks (attention,
    feed-forward, modulation; 14 and 6 per block), none of the embedders, final norm or output."""
    family = get_family("flux")
    model = family.model_cls()(**family.tiny_config)
    expected = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                and n.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    add_lora(model, LoraSettings(rank=2, target_modules="all-linear"), family.lora_targets, family)
    assert set(adapter_layers(model)) == expected and len(expected) == 8 * 14 + 8 * 6
    with pytest.raises(LoraConfigError, match="all-linear' is invalid here"):
        add_lora(family.model_cls()(**family.tiny_config), LoraSettings(target_modules="all-linear"), ("to_q",))


def test_the_header_names_an_adapter_of_another_type_or_rank_before_any_model_loads(trained):
    lokr, loha = trained("wan", ADAPTER_FILES["lokr"])[-1], trained("wan", ADAPTER_FILES["loha"])[-1]
    with pytest.raises(ConfigError, match=r"holds a lokr adapter; this run's lora_type is 'lora': allowed a lora "
                                          r"file, or set lora_type to lokr"):
        check_init_lora(lokr, "wan", 4)
    check_init_lora(lokr, "wan", 4, "lokr")  # its factors are full matrices at this size: no rank to compare
    with pytest.raises(ConfigError, match=r"has rank 4 \(\d+ modules\); this run's lora_rank is 8"):
        check_init_lora(loha, "wan", 8, "loha")
    with pytest.raises(ConfigError, match=r"this file is a LoRA \(\d+ adapted modules"):
        check_not_a_lora(loha, safetensors_header(loha, "model file", ""))


def test_lokr_factor_reaches_peft_and_shapes_the_kronecker_factors():
    """Issue 35 (SimpleTuner's LyCORIS factor): ``lokr_factor`` is peft's ``decompose_factor``; the
    LoRA Config node passes it."""
    from peft import get_peft_model

    from segmented_checkpointing.engine.model.adapters import peft_config
    from segmented_checkpointing.nodes.model_nodes import LoRAConfig

    settings = LoRAConfig.execute(rank=2, alpha=2, dropout=0.0, target_modules="proj", lora_type="lokr",
                                  lokr_factor=2)[0]
    assert settings.factor == 2 and peft_config(settings, ["proj"]).decompose_factor == 2
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(16, 32))
    layer = get_peft_model(model, peft_config(settings, ["proj"])).base_model.model.proj
    assert tuple(layer.lokr_w1["default"].shape) == (2, 2)  # out 32 = 2 x 16, in 16 = 2 x 8: w1 takes the factor
    default = get_peft_model(torch.nn.Sequential(torch.nn.Linear(16, 32)),
                             peft_config(LoraSettings(rank=2, alpha=2, lora_type="lokr"), ["0"]))
    assert tuple(default.base_model.model[0].lokr_w1["default"].shape) == (4, 4)  # -1: 32 = 4 x 8, 16 = 4 x 4


def test_a_full_matrix_lokr_keeps_both_factors_whole_and_scales_by_one():
    """LyCORIS' ``full_matrix`` (SimpleTuner's LoKr examples): no low-rank factor, the update
    ``w1 kron w2`` unscaled; rank and alpha are not used. The LoRA Config node passes it."""
    from peft import get_peft_model

    from segmented_checkpointing.engine.model.adapters import FULL_RANK, peft_config
    from segmented_checkpointing.nodes.model_nodes import LoRAConfig

    settings = LoRAConfig.execute(rank=2, alpha=1, dropout=0.0, target_modules="0", lora_type="lokr", lokr_factor=4,
                                  lokr_full_matrix=True)[0]
    assert settings.full_matrix and peft_config(settings, ["0"]).r == peft_config(settings, ["0"]).alpha == FULL_RANK
    layer = get_peft_model(torch.nn.Sequential(torch.nn.Linear(64, 96)), peft_config(settings, ["0"])).base_model.model[0]
    assert set(layer.lokr_w1) == set(layer.lokr_w2) == {"default"} and not layer.lokr_w2_a  # both whole
    assert tuple(layer.lokr_w1["default"].shape) == (4, 4) and tuple(layer.lokr_w2["default"].shape) == (24, 16)
    assert layer.scaling["default"] == 1.0
    with pytest.raises(LoraConfigError, match=r"^lokr_full_matrix=True is invalid with lora_type='loha': allowed false"):
        LoraSettings(lora_type="loha", full_matrix=True)
