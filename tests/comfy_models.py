"""Random-init models that a real ComfyUI loads with its own loader nodes, written into a ComfyUI
base folder for the closed-loop workflow (workflows/closed_loop_sd3.json) in the live tests.

ComfyUI builds its SD3 text encoder and VAE at their released sizes whatever the file holds (CLIP-L:
width 768, 12 layers; VAE: channels 128-256-512-512, 16 latent channels), so those two are full
size (random, fp16: about 250 and 170 MB); the transformer is a tiny SD3.5-style MMDiT (2 joint
blocks, width 128 = 64 x depth as ComfyUI's MMDiT requires, one dual-attention block) written in
Stability AI's original key layout. File names are those the workflow ships with, the names of the
released files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from original_layouts import sd3_to_mmdit
from PIL import Image
from safetensors.torch import save_file

TRANSFORMER = "sd3.5_medium.safetensors"
TEXT_ENCODER = "clip_l.safetensors"
VAE = "sd3.5_vae.safetensors"
IMAGES = ("astronaut.png", "coffee.png")

# SD3Transformer2DModel config: ComfyUI reads depth from the width (64 per block), heads = depth
TINY_SD3 = {"sample_size": 32, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
            "attention_head_dim": 64, "num_attention_heads": 2, "joint_attention_dim": 4096,
            "caption_projection_dim": 128, "pooled_projection_dim": 2048, "pos_embed_max_size": 32,
            "dual_attention_layers": (0,), "qk_norm": "rms_norm"}


COMFY_SMALL = {
    # family -> a diffusers config ComfyUI 0.3.64's model_detection builds as it is (it derives these
    # sizes from the shapes; the rest it hard-codes at the released values, which these keep)
    "sd3": TINY_SD3,
    # Wan: heads = width / 128, text width 4096, freq 256, q/k norms, cross-attention norm
    "wan": {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 256, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6},
}


def _over_tiny(family: str, **overrides) -> dict:
    from segmented_checkpointing.engine.families import get_family

    return {**get_family(family).tiny_config, **overrides}


COMFY_SMALL.update({
    # hidden = heads x 128, rotary axes (16, 56, 56), MLP ratio 4, two refiner blocks, pooled CLIP 768
    "hunyuanvideo": _over_tiny("hunyuanvideo", num_attention_heads=1, attention_head_dim=128, num_layers=1,
                               num_single_layers=1, num_refiner_layers=2, mlp_ratio=4.0, pooled_projection_dim=768,
                               rope_axes_dim=(16, 56, 56)),
    # 32 heads, caption width 4096, cross-attention width = hidden
    "ltxvideo": _over_tiny("ltxvideo", num_attention_heads=32, attention_head_dim=4, cross_attention_dim=128,
                           caption_channels=4096, num_layers=2),
    # Predict 2: 16 heads, 10 blocks, text 1024, AdaLN-LoRA 256, the padding-mask channel
    "cosmos": _over_tiny("cosmos", num_attention_heads=16, attention_head_dim=16, num_layers=10, mlp_ratio=4.0,
                         text_embed_dim=1024, adaln_lora_dim=256, concat_padding_mask=True, extra_pos_embed_type=None),
    # heads of 128, frequency width 256, text 4096, VACE blocks at 0 and 2
    "wanvace": _over_tiny("wanvace", num_attention_heads=1, attention_head_dim=128, freq_dim=256, text_dim=4096,
                          num_layers=4, vace_layers=(0, 2)),
    # SD 1.x-shaped: ComfyUI's 32 norm groups need >= 32 channels; 320/640, cross-attention first (SD15)
    "unet2dcondition": _over_tiny("unet2dcondition", block_out_channels=(320, 640), layers_per_block=1,
                                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=768,
                                  attention_head_dim=8, transformer_layers_per_block=1, addition_embed_type=None,
                                  projection_class_embeddings_input_dim=None, addition_time_embed_dim=None,
                                  use_linear_projection=False, norm_num_groups=32, in_channels=4, out_channels=4,
                                  sample_size=32),
})
"""Small models of the families' released layouts that ComfyUI builds (tests/live/test_comfyui_lora_keys.py)."""


CLOSED_LOOP_FLUX = {
    # Flux.1-dev's layout at the width ComfyUI hard-codes (3072, 24 heads of 128), one block of each
    # kind; pooled width 2048: the live test encodes with CLIP-L alone through CLIPLoader(type=sd3),
    # whose pooled output is CLIP-L's 768 padded to 2048 (no T5-XXL, 4.7B parameters, on a CPU runner)
    "patch_size": 1, "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 2048, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
CLOSED_LOOP_FILES = {  # family -> (transformer file, VAE file) the shipped closed loop names
    "sd3": (TRANSFORMER, VAE), "flux": ("flux1-dev.safetensors", "ae.safetensors"),
    "wan": ("wan2.1_t2v_1.3B_fp16.safetensors", "wan_2.1_vae.safetensors"),
}


def write_transformer(path: Path, family: str, config: dict, seed: int = 0) -> Path:
    """A random-init ``family`` transformer of ``config`` in its released layout (fp16) at ``path``."""
    from segmented_checkpointing.engine.families import get_family
    from segmented_checkpointing.engine.model.layouts import get_layout

    torch.manual_seed(seed)
    model = get_family(family).model_cls()(**config)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(_fp16(get_layout(family).to_original(model.state_dict())), str(path))
    return path


def tiny_sd3_transformer(seed: int = 0):
    """The tiny ``SD3Transformer2DModel`` (fp32) whose original-layout file the workflow loads."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(**TINY_SD3).eval()


def _fp16(state: dict) -> dict:
    return {k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}


def write_closed_loop_files(base: Path, seed: int = 0) -> dict[str, Path]:
    """Write the transformer, CLIP-L, VAE and two input images under ``base`` (a ComfyUI base
    folder: ``models/...``, ``input/``). Returns the written paths by role."""
    from diffusers import AutoencoderKL
    from skimage import data
    from transformers import CLIPTextConfig, CLIPTextModel

    paths = {"transformer": base / "models" / "diffusion_models" / TRANSFORMER,
             "text_encoder": base / "models" / "text_encoders" / TEXT_ENCODER,
             "vae": base / "models" / "vae" / VAE}
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd3_to_mmdit(tiny_sd3_transformer(seed).state_dict()).items()},
              str(paths["transformer"]))
    torch.manual_seed(seed + 1)
    clip = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
                                        hidden_act="quick_gelu"))
    state = {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in clip.state_dict().items()}
    state["text_projection.weight"] = torch.randn(768, 768) * 768 ** -0.5
    save_file(_fp16(state), str(paths["text_encoder"]))  # the released file's keys (transformers 4 names)
    del clip
    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(128, 256, 512, 512), use_quant_conv=False, use_post_quant_conv=False,
                        scaling_factor=1.5305, shift_factor=0.0609)
    save_file(_fp16(vae.state_dict()), str(paths["vae"]))
    del vae
    # the Flux closed loop: its transformer; its VAE has the SD3 VAE's structure (16 latent channels)
    write_transformer(base / "models" / "diffusion_models" / CLOSED_LOOP_FILES["flux"][0], "flux", CLOSED_LOOP_FLUX)
    (base / "models" / "vae" / CLOSED_LOOP_FILES["flux"][1]).write_bytes(paths["vae"].read_bytes())
    write_transformer(base / "models" / "diffusion_models" / CLOSED_LOOP_FILES["wan"][0], "wan", COMFY_SMALL["wan"])
    (base / "input").mkdir(parents=True, exist_ok=True)
    for name in IMAGES:
        pixels = getattr(data, name.removesuffix(".png"))()
        Image.fromarray(np.asarray(pixels)).convert("RGB").save(base / "input" / name)
        paths[name] = base / "input" / name
    return paths
