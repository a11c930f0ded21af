"""LoRA files in ComfyUI's names (``lora_format comfyui``): for every family with a released layout,
the file's deltas added to the released-layout weights and converted back by the family's
conversion (diffusers' own function) give the weights peft merges from the trained adapter; fused
projections are one exact LoRA (A stacked, B block-diagonal) that splits back exactly; the CLI
writes both files and an ``init_lora`` of either format continues the same adapter.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file

from segmented_checkpointing import cli
from segmented_checkpointing.engine.config import ConfigError, LoraSettings, TrainConfig
from segmented_checkpointing.engine.families import get_family
from segmented_checkpointing.engine.families.comfyui import LAYOUT_MODULES
from segmented_checkpointing.engine.model.adapters import fold_scales
from segmented_checkpointing.engine.model.comfy_lora import DOWN, UP, base_shapes, from_comfy_keys, to_comfy_keys
from segmented_checkpointing.engine.model.layouts import LayoutError, get_layout, layout_families
from segmented_checkpointing.engine.model.lora_files import (
    LoraWeights,
    adapter_scales,
    add_lora,
    load_lora_file,
    lora_state_dict,
    save_lora_files,
)
from segmented_checkpointing.engine.model.lora_header import check_init_lora, modules_of
from segmented_checkpointing.engine.train.checks import check_lora_format

SETTINGS = LoraSettings(rank=4, alpha=8, init="gaussian")  # peft scale 2, folded into B


def _adapted(name: str, targets=None):
    """(base model, adapted copy with non-zero lora_B) of the family's tiny preset, fp32."""
    family = get_family(name)
    torch.manual_seed(0)
    base = family.model_cls()(**family.tiny_config).float().eval()
    model = copy.deepcopy(base)
    add_lora(model, SETTINGS, targets or family.lora_targets)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.05)
    return base, model


def _bare(model) -> dict[str, torch.Tensor]:
    scales = adapter_scales(model)
    return {k: v * scales[k.partition(".lora_B.")[0]] if ".lora_B." in k else v
            for k, v in lora_state_dict(model).items()}


def _merged(model) -> dict[str, torch.Tensor]:
    """The diffusers-layout weights with the adapter merged by peft itself (the oracle)."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
            if not any(f".{p}_" in k for p in ("lora", "lokr", "hada"))}


SUFFIXES = ("lora_up.weight", "lora_down.weight", "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1",
            "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "dora_scale", "alpha")
EPS = torch.finfo(torch.float32).eps


def _update(t: dict, shape) -> tuple[torch.Tensor, float]:
    """ComfyUI's update of one adapter's tensors ``t`` (suffix -> tensor) and its ``alpha / rank`` (1
    without ``alpha``): ``weight_adapter/lora.py`` ``up.flatten(1) @ down.flatten(1)``; ``loha.py``
    ``(w1_a @ w1_b) * (w2_a @ w2_b)``; ``lokr.py`` ``kron(w1, w2)`` with each factor whole or ``a @ b``,
    the rank the last decomposed factor's."""
    alpha = t.get("alpha")
    if "lora_up.weight" in t:
        up, down = t["lora_up.weight"], t["lora_down.weight"]
        return (up.flatten(1) @ down.flatten(1)).reshape(shape), alpha / down.shape[0] if alpha is not None else 1.0
    if "hada_w1_a" in t:
        product = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        return product.reshape(shape), alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
    rank, factors = None, []
    for w in ("lokr_w1", "lokr_w2"):
        if w in t:
            factors.append(t[w])
        else:
            rank = t[w + "_b"].shape[0]
            factors.append(t[w + "_a"] @ t[w + "_b"])
    w1 = factors[0][:, :, None, None] if factors[1].dim() == 4 else factors[0]
    return torch.kron(w1, factors[1]).reshape(shape), alpha / rank if alpha is not None and rank else 1.0


def comfyui_apply(original: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], prefix: str) -> set[str]:
    """Add each adapter of ``lora`` to the weights as ComfyUI 0.3.64 does (``comfy/lora.py``:
    ``diffusion_model.<key>`` or ``lora_unet_<key with _>`` -> ``<key>.weight``; ``<name>.alpha`` and
    ``<name>.dora_scale`` read beside the adapter; ``weight_adapter/base.py`` ``weight_decompose``: with
    a ``dora_scale`` of the weight's rows, ``(W + dW) * dora_scale / (||W|| + eps)``, the norm of each
    row of ``W`` before the update); the names it used."""
    by_name = {(prefix + k[: -len(".weight")]) if prefix != "lora_unet_" else
               "lora_unet_" + k[: -len(".weight")].replace(".", "_"): k for k in original if k.endswith(".weight")}
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in lora.items():
        suffix = next(s for s in SUFFIXES if key.endswith("." + s))
        grouped.setdefault(key[: -len(suffix) - 1], {})[suffix] = value.float()
    used = set()
    for name, t in grouped.items():
        weight = original[by_name[name]].float()
        update, scale = _update({k: v.item() if k == "alpha" else v for k, v in t.items()}, weight.shape)
        patched = weight + scale * update
        if "dora_scale" in t:
            assert t["dora_scale"].shape[0] == weight.shape[0]  # the output axis, as peft's DoRA
            norm = weight.reshape(weight.shape[0], -1).norm(dim=1).reshape((-1,) + (1,) * (weight.dim() - 1))
            patched = patched * (t["dora_scale"] / (norm + EPS))
        original[by_name[name]] = patched
        used |= {f"{name}.{s}" for s in t}
    return used


@pytest.mark.parametrize("name", layout_families())
def test_comfyui_file_changes_the_released_weights_by_the_trained_update(name):
    base, model = _adapted(name)
    layout = get_layout(name)
    lora = to_comfy_keys(_bare(model), layout, base_shapes(model))
    original = layout.to_original(base.state_dict())
    assert comfyui_apply(original, lora, layout.lora_prefix) == set(lora)  # every key applies
    got = layout.from_original(original, dict(model.config)) if layout.needs_config else layout.from_original(original)
    want = _merged(model)
    assert got.keys() == want.keys()
    changed = 0
    for key, value in want.items():
        scale = value.abs().max().clamp_min(1e-12)
        assert (got[key] - value).abs().max() / scale <= 1e-5, key
        changed += not torch.equal(value, base.state_dict()[key])
    assert changed == len(lora) // 2 + sum(len(_parts(lora, k)) - 1 for k in lora if k.endswith(DOWN))


def _parts(lora, down_key) -> list:
    return [None] * (lora[down_key].shape[0] // SETTINGS.rank)


@pytest.mark.parametrize("name", ["flux", "sd3", "wan", "lumina2", "zimage"])
def test_fused_projections_are_one_exact_lora_that_splits_back(name):
    base, model = _adapted(name)
    layout, bare = get_layout(name), _bare(model)
    lora = to_comfy_keys(bare, layout, base_shapes(model))
    fused = [k for k in lora if k.endswith(DOWN) and lora[k].shape[0] > SETTINGS.rank]
    if name == "wan":
        assert not fused  # Wan's q, k, v are separate weights in the released layout too
    else:
        assert fused
        up = lora[fused[0].replace(DOWN, UP)]
        parts = lora[fused[0]].shape[0] // SETTINGS.rank
        rows = up.shape[0]
        assert parts >= 3 and up.shape[1] == parts * SETTINGS.rank
        assert torch.count_nonzero(up) <= rows * SETTINGS.rank  # block-diagonal: one part per row
    modules = sorted(k[: -len(".lora_A.weight")] for k in bare if k.endswith(".lora_A.weight"))
    back = from_comfy_keys(lora, layout, base_shapes(model), modules)
    assert back.keys() == bare.keys() and all(torch.equal(back[k], bare[k]) for k in bare)


def test_flux_single_block_linear1_holds_q_k_v_and_zero_mlp_rows():
    base, model = _adapted("flux")
    lora = to_comfy_keys(_bare(model), get_layout("flux"), base_shapes(model))
    up = lora["diffusion_model.single_blocks.0.linear1" + UP]
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    assert up.shape == (3 * hidden + 4 * hidden, 3 * SETTINGS.rank)  # [q; k; v; mlp-in] rows, rank 3r
    assert torch.count_nonzero(up[3 * hidden:]) == 0  # proj_mlp is not a LoRA target: its rows stay
    for i in range(3):
        block = up[i * hidden:(i + 1) * hidden]
        assert torch.count_nonzero(block[:, i * SETTINGS.rank:(i + 1) * SETTINGS.rank]) > 0
        assert torch.count_nonzero(block) == torch.count_nonzero(block[:, i * SETTINGS.rank:(i + 1) * SETTINGS.rank])


def test_a_fused_lora_that_is_not_block_diagonal_is_refused():
    base, model = _adapted("flux")
    layout, bare = get_layout("flux"), _bare(model)
    lora = to_comfy_keys(bare, layout, base_shapes(model))
    key = "diffusion_model.double_blocks.0.img_attn.qkv" + UP
    lora[key] = lora[key].clone()
    lora[key][0, -1] = 1.0  # q's row reading v's columns
    modules = sorted(k[: -len(".lora_A.weight")] for k in bare if k.endswith(".lora_A.weight"))
    with pytest.raises(ValueError, match="not block-diagonal"):
        from_comfy_keys(lora, layout, base_shapes(model), modules)


def test_comfyui_format_is_refused_for_a_family_without_a_layout():
    assert "pixart" not in LAYOUT_MODULES
    config = TrainConfig.create(family="pixart", lora_format="comfyui")
    with pytest.raises(ConfigError, match=r"lora_format='comfyui' is invalid for family 'pixart'.*allowed diffusers or both"):
        _check_format(config)
    _check_format(TrainConfig.create(family="pixart", lora_format="both"))  # the diffusers file alone


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_cli_trains_two_steps_and_writes_both_files_of_one_update(tmp_path, family):
    out = tmp_path / "out"
    args = ["train", "--family", family, "--steps", "2", "--resolution", "32", "--output", str(out)]
    assert cli.main(args) == 0
    diffusers, comfy = load_file(str(out / "lora.safetensors")), load_file(str(out / "lora_comfyui.safetensors"))
    with safe_open(str(out / "lora_comfyui.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert meta["lora_format"] == "comfyui" and meta["family"] == family
    layout = get_layout(family)
    base, model = _adapted(family)
    modules = sorted(k[len("transformer."): -len(".lora_A.weight")] for k in diffusers if k.endswith(".lora_A.weight"))
    back = from_comfy_keys(comfy, layout, base_shapes(model), modules)
    assert back.keys() == {k.removeprefix("transformer.") for k in diffusers}
    for key, value in back.items():
        assert torch.equal(value, diffusers["transformer." + key]), key
    assert any(torch.count_nonzero(v) for k, v in back.items() if ".lora_B." in k)  # trained: B moved off zero
    # either file starts a run's adapter at the same weights (init_lora)
    settings = LoraSettings(**json.loads(meta["lora_settings"]))
    states = []
    for name in ("lora.safetensors", "lora_comfyui.safetensors"):
        check_init_lora(out / name, family, settings.rank)
        fresh = copy.deepcopy(base)
        add_lora(fresh, settings, get_family(family).lora_targets)
        assert load_lora_file(fresh, out / name, settings, family) == len(modules)
        states.append(lora_state_dict(fresh))
    assert all(torch.allclose(states[0][k], states[1][k], rtol=0, atol=1e-7) for k in states[0])


ADAPTERS = {  # every Linear of the blocks: fused, reordered and plain released weights alike
    "dora": LoraSettings(rank=4, alpha=8, use_dora=True, init="gaussian", target_modules="all-linear"),
    "lokr": LoraSettings(rank=2, alpha=8, lora_type="lokr", target_modules="all-linear"),
    "lokr_full": LoraSettings(lora_type="lokr", full_matrix=True, factor=4, target_modules="all-linear"),
    "loha": LoraSettings(rank=2, alpha=6, lora_type="loha", target_modules="all-linear"),
}


def _adapted_with(name: str, settings: LoraSettings):
    """(base, adapted copy) whose adapter moves every weight: zero-initialised tensors drawn, DoRA's
    magnitude off the base's norms."""
    family = get_family(name)
    torch.manual_seed(0)
    base = family.model_cls()(**family.tiny_config).float().eval()
    model = copy.deepcopy(base)
    add_lora(model, settings, family.lora_targets, family)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.requires_grad:
                p.mul_(1.1) if "magnitude" in key else p.normal_(0, 0.1)
    return base, model


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_comfyui_file_of_each_adapter_changes_the_weights_by_the_trained_update(name, adapter):
    """Issue 35: DoRA's dora_scale, LoHa's and LoKr's factors, in ComfyUI's names, applied as ComfyUI
    applies them, give peft's merged weights; a LoKr on fused weights goes in the diffusers names
    ComfyUI maps for Flux and SD3; LoHa and LoKr files split back exactly."""
    base, model = _adapted_with(name, ADAPTERS[adapter])
    layout, weights = get_layout(name), LoraWeights.of(model)
    bare = fold_scales(weights.state, weights.scales)
    lora = to_comfy_keys(bare, layout, weights.shapes, weights.norms)
    in_diffusers_names = all(k.startswith("transformer.") for k in lora)
    assert in_diffusers_names == (adapter.startswith("lokr") and name != "wan")  # Wan's weights are released unfused
    if in_diffusers_names:
        got = dict(base.state_dict())
        assert comfyui_apply(got, lora, "transformer.") == set(lora)
    else:
        original = layout.to_original(base.state_dict())
        assert comfyui_apply(original, lora, layout.lora_prefix) == set(lora)  # no "lora key not loaded"
        got = layout.from_original(original)
    want = _merged(model)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert (got[key] - value).abs().max() / value.abs().max().clamp_min(1e-12) <= 1e-5, key
    changed = sum(not torch.equal(value, base.state_dict()[key]) for key, value in want.items())
    assert changed == len(modules_of(bare)) > 0
    if adapter != "dora" and not in_diffusers_names:
        back = from_comfy_keys(lora, layout, weights.shapes, modules_of(bare), ADAPTERS[adapter].lora_type)
        assert back.keys() == bare.keys() and all(torch.equal(back[k], bare[k]) for k in bare)


def test_a_lokr_comfyui_cannot_apply_exactly_is_refused_before_training(tmp_path):
    """Z-Image fuses q, k and v in its released layout and ComfyUI maps no diffusers names for it: a
    Kronecker product of the fused weight is not the three parts' (issue 35)."""
    config = TrainConfig.create(family="zimage", lora_type="lokr")
    with pytest.raises(ConfigError, match=r"^lora_format='both' is invalid: lora_type='lokr' cannot be written as a "
                                          r"ComfyUI file for zimage: its released layout fuses .*to_q, .*to_k, .*to_v "
                                          r"into .*qkv.*; allowed lora_format=diffusers \(the peft file\)"):
        _check_format(config)
    _check_format(config.replace(lora_format="diffusers"))
    _check_format(config.replace(lora_type="loha"))  # a LoHa fuses exactly
    _check_format(config.replace(family="flux"))  # ComfyUI maps Flux's diffusers names
    base, model = _adapted_with("zimage", LoraSettings(rank=2, alpha=8, lora_type="lokr"))
    with pytest.raises(LayoutError, match="lora_type='lokr' cannot be written as a ComfyUI file for zimage"):
        save_lora_files(model, tmp_path / "lora.safetensors", config.lora, "zimage")
    assert not list(tmp_path.iterdir())  # refused before any file is written


def _check_format(config):
    """:func:`check_lora_format` of ``config``'s components."""
    check_lora_format(config.model, config.lora, config.outputs.lora_format)
