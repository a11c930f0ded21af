"""docs/RECIPES.md, generated (``segckpt recipes``; a test compares the committed file with this output):
each family's default training recipe here, with its ``flow_shift=auto`` resolved at 512 and 1024 px
(video families: 480 x 832 px, 81 frames) through :class:`~..train.objectives.NoiseSchedule`, and what
the peers (musubi-tuner, SimpleTuner, diffusers' DreamBooth LoRA scripts) train with by default, each
value with the file and commit it was read from.
"""

from __future__ import annotations

from ..config import ObjectiveConfig, TrainConfig
from ..config.peers.recipe import DEFAULTS
from ..families import family_names, get_family
from ..families.limits import full_config
from ..train.objectives import NoiseSchedule

SIZES = ((512, 512, 1), (1024, 1024, 1))
"""Image sizes the auto shift is resolved at: ``(height, width, frames)`` in pixels."""
VIDEO_SIZE = (480, 832, 81)
"""The video families' size: Wan's 480p at 81 frames."""
PIXELS_PER_LATENT = {"ltxvideo": 32, "ltx2video": 32, "sana": 32, "sanavideo": 32}
"""Pixels per latent cell of a family's released VAE where not 8 (only dynamic shifts need it)."""

MUSUBI = "kohya-ss/musubi-tuner @ 30c658c (2026-06-24)"
SIMPLETUNER = "bghira/SimpleTuner @ bc8e6ab (2026-08-22)"
DIFFUSERS = "huggingface/diffusers @ 58eb52c (2026-08-23)"
_FIELDS = "simpletuner/simpletuner_sdk/server/services/field_registry/sections"
_PARSER = "src/musubi_tuner/training/parser_common.py"
PEERS: tuple[tuple[str, str, str, str], ...] = (
    # (peer, setting, default, source file)
    (MUSUBI, "timestep_sampling", "`sigma`; its docs recommend `flux_shift` for FLUX.1 "
     "Kontext, `flux2_shift` for FLUX.2, `shift` with `--discrete_flow_shift 2.2` (or `qwen_shift`) for Qwen-Image, "
     "`shift` with `--discrete_flow_shift 3.0` for Wan", f"{_PARSER}; in its docs folder flux_kontext.md, "
     "flux_2.md, qwen_image.md, wan.md"),
    (MUSUBI, "discrete_flow_shift", "1.0", _PARSER),
    (MUSUBI, "weighting_scheme / logit_mean / logit_std / mode_scale", "none / 0.0 / 1.0 / 1.29", _PARSER),
    (MUSUBI, "guidance_scale (trained guidance)", "1.0 (its help: HunyuanVideo only); FLUX.1 Kontext trains at a "
     "fixed 1.0", f"{_PARSER}, src/musubi_tuner/flux_kontext_train_network.py"),
    (MUSUBI, "max_grad_norm", "1.0", _PARSER),
    (MUSUBI, "optimizer_type", "AdamW (empty string)", _PARSER),
    (MUSUBI, "learning_rate", "2e-6", _PARSER),
    (MUSUBI, "network_alpha", "1", _PARSER),
    (MUSUBI, "caption dropout", "no training option found (not verified)", _PARSER),
    (MUSUBI, "LoRA targets (Flux)", "every Linear of the double and single blocks except the modulation "
     "(`img_mod.lin`, `txt_mod.lin`, `modulation.lin`) and norm layers: all-linear less the modulation",
     "src/musubi_tuner/networks/lora_flux.py"),
    (MUSUBI, "LoRA targets (Wan, Qwen-Image)", "every Linear of `WanAttentionBlock` / `QwenImageTransformerBlock` "
     "except norms and embeddings (Wan) or the `_mod_` layers (Qwen-Image): all-linear less the modulation",
     "src/musubi_tuner/networks/lora_wan.py, lora_qwen_image.py"),
    (SIMPLETUNER, "flow_schedule_auto_shift", "false (Flux's calculate_shift of the latent tokens when on and "
     "the static shift is 0)", f"{_FIELDS}/advanced.py, simpletuner/helpers/training/custom_schedule.py"),
    (SIMPLETUNER, "flow_use_uniform_schedule / flow_sigmoid_scale", "false / 1.0", f"{_FIELDS}/advanced.py"),
    (SIMPLETUNER, "flux_guidance_value", "1.0", "simpletuner/helpers/models/field_registry/flux.py"),
    (SIMPLETUNER, "optimizer", "adamw_bf16", f"{_FIELDS}/training.py"),
    (SIMPLETUNER, "lora_type / lora_rank", "standard / 16", f"{_FIELDS}/lora.py"),
    *((SIMPLETUNER, d.key, "unset (= rank)" if d.value is None else f"{d.value:g}", f"{_FIELDS}/{d.source}")
      for d in DEFAULTS),  # the defaults a SimpleTuner file takes here: one table (engine/config/peers/recipe.py)
    (SIMPLETUNER, "LoRA targets", "Flux (`flux_lora_target` all): the attention projections (`to_q/k/v`, "
     "`add_q/k/v_proj`, `to_qkv`, `to_out.0`, `to_add_out`); SD3, Wan, Qwen-Image: `to_q/k/v`, `to_out.0` - "
     "the attention preset", "simpletuner/helpers/models/field_registry/flux.py, flux/model.py, common.py"),
    (DIFFUSERS, "weighting_scheme", "`none` (uniform draws, no weights) in the Flux and Sana scripts; "
     "`logit_normal` in the SD3 script", "examples/dreambooth/train_dreambooth_lora_{flux,sana,sd3}.py"),
    (DIFFUSERS, "shift", "the scheduler's static `shift` at its construction (SD3: 3.0); none for Flux (dynamic "
     "shifting leaves the training sigmas unshifted)", "examples/dreambooth/train_dreambooth_lora_{flux,sd3}.py"),
    (DIFFUSERS, "logit_mean / logit_std / mode_scale", "0.0 / 1.0 / 1.29",
     "examples/dreambooth/train_dreambooth_lora_{flux,sana,sd3}.py"),
    (DIFFUSERS, "guidance_scale (Flux, trained guidance)", "3.5", "examples/dreambooth/train_dreambooth_lora_flux.py"),
    (DIFFUSERS, "max_grad_norm / optimizer", "1.0 / AdamW (or prodigy)",
     "examples/dreambooth/train_dreambooth_lora_{flux,sana,sd3}.py"),
    (DIFFUSERS, "rank / lora_alpha", "4 / 4 (SD3: alpha = rank)",
     "examples/dreambooth/train_dreambooth_lora_{flux,sana,sd3}.py"),
    (DIFFUSERS, "LoRA targets", "Flux: the attention projections plus the double blocks' feed-forwards "
     "(`ff.net.*`, `ff_context.net.*`); SD3: the attention projections; Sana: `to_q/k/v`",
     "examples/dreambooth/train_dreambooth_lora_{flux,sd3,sana}.py"),
)
"""What each peer trains with when the option is not given: ``(peer, setting, default, file)``, read from
the files at the commits named (restated, never copied)."""

PRESETS = (
    "| peer | default LoRA targets | nearest preset here |\n|---|---|---|\n"
    "| musubi-tuner (networks.lora_flux, lora_wan, lora_qwen_image) | every Linear in the blocks but the "
    "modulation | `all-linear` |\n"
    "| SimpleTuner | the attention projections | `attention` |\n"
    "| diffusers' Flux script | the attention projections and the double blocks' feed-forwards | neither: name the "
    "modules |\n"
    "| diffusers' SD3 / Sana scripts | the attention projections (Sana: q, k, v only) | `attention` |\n"
)
"""Which peer trains which ``lora_target_modules`` preset by default (from :data:`PEERS`' target rows)."""


MAX_TARGETS = 6
"""Target names shown per family; a longer list (per-block names) is cut with its count."""


def _shift(name: str) -> str:
    """What ``flow_shift=auto`` resolves to for family ``name``: a static shift once, a dynamic one at each of
    :data:`SIZES` (video: :data:`VIDEO_SIZE`) with its image tokens; ``-`` for an epsilon family."""
    family = get_family(name)
    declared = family.flow_shift
    if family.objective != "flow":
        return "-"
    if declared is None:
        return "1 (none declared)"
    if not declared.use_dynamic_shifting:
        return f"{declared.shift:g}"
    noise = NoiseSchedule(family, ObjectiveConfig(), declared, full_config(family.model_cls(), {}))
    down, parts = PIXELS_PER_LATENT.get(name, 8), []
    for height, width, frames in (VIDEO_SIZE,) if family.frames is not None else SIZES:
        latent: tuple[int, ...] = (family.latent_channels, height // down, width // down)
        where = f"{height} px"
        if family.frames is not None:
            latent, where = (latent[0], (frames - 1) // family.frames.temporal + 1, *latent[1:]), \
                f"{height}x{width}, {frames} frames"
        resolved = noise.shift_for(latent)
        parts.append(f"{resolved.shift:.4g} at {where} ({resolved.tokens} tokens)")
    return " / ".join(parts)


def _targets(targets: tuple[str, ...]) -> str:
    shown = ", ".join(f"`{t}`" for t in targets[:MAX_TARGETS])
    return shown if len(targets) <= MAX_TARGETS else f"{shown}, ... ({len(targets)} modules)"


def family_rows() -> list[str]:
    """One Markdown row per family: prediction, default sampling, the auto shift, guidance, the
    ``attention`` preset's modules."""
    objective = ObjectiveConfig()
    rows = []
    for name in family_names():
        family = get_family(name)
        sampling = (f"logit_normal({objective.logit_mean:g}, {objective.logit_std:g})" if family.objective == "flow"
                    else "uniform DDPM steps")
        guidance = f"yes ({objective.guidance_value:g})" if family.guidance_input else "-"
        rows.append(f"| {name} | {family.objective} | {sampling} | {_shift(name)} | {guidance} | "
                    f"{_targets(family.lora_targets)} |")
    return rows


def recipes_markdown() -> str:
    """docs/RECIPES.md: the families' default recipes, the peers' defaults with their sources, and which
    peer trains which target preset by default (imports diffusers: the families' model configs)."""
    config = TrainConfig()
    opt, lora = config.optimizer, config.lora
    lines = [
        "# Training recipes\n",
        "Generated by `segckpt recipes`; do not edit. The options are in docs/OPTIONS.md; "
        "`report.json`'s `recipe` section and the line a run prints first say what a run used.\n",
        "## Defaults here\n",
        f"Every family: `loss_weighting` {config.objective.loss_weighting}, `max_grad_norm` {opt.max_grad_norm:g}, "
        f"`caption_dropout` {config.data.caption_dropout:g}, `optimizer` {opt.name} at `learning_rate` "
        f"{opt.learning_rate:g}, `lora_type` {lora.lora_type} rank {lora.rank} alpha {lora.alpha:g}, "
        "`lora_target_modules` attention (the family's attention projections, listed below; `all-linear`: "
        "every Linear inside the blocks). *auto shift*: what `flow_shift=auto` shifts by at that size from the "
        "family's released scheduler config (docs/FAMILIES.md \"Noise schedule\"; a model folder's own "
        "`scheduler/scheduler_config.json` replaces it); a resolution-dependent one at 512 and 1024 px (video: "
        "480x832 px, 81 frames) with its image tokens; "
        "epsilon families draw DDPM steps uniformly and bin their loss by noise level at `t / 1000`.\n",
        "| family | prediction | sampling | auto shift | guidance input (default) | attention preset |",
        "|---|---|---|---|---|---|",
        *family_rows(),
        "\n## What the peers use by default\n",
        "Read from each file at the commit named; values restated. Where a value could not be read from a "
        "source it says *not verified*.\n",
        "| peer | setting | default | source |", "|---|---|---|---|",
        *(f"| {peer} | {setting} | {value} | `{source}` |" for peer, setting, value, source in PEERS),
        "\n## Which peer trains which target preset by default\n",
        PRESETS,
    ]
    return "\n".join(lines)
