"""Write a random-init Wan 2.1 VAE in ComfyUI's own layout (the released file's keys), with
ComfyUI's interpreter: ``python comfy_write_wan_vae.py COMFYUI_PATH OUT_FILE``.

ComfyUI builds its Wan VAE at the released size from ``comfy/sd.py``'s ``ddconfig`` whatever the
file holds; the class is ComfyUI's (``comfy/ldm/wan/vae.py``), run here, not copied. Its layers
skip their own initialisation, so the weights are drawn here: N(0, 1/fan_in), biases 0, norms 1.
"""

from __future__ import annotations

import sys


def main(comfyui: str, out_file: str) -> None:
    sys.path.insert(0, comfyui)
    from comfy.cli_args import args

    args.cpu = True
    import torch
    from comfy.ldm.wan.vae import WanVAE
    from safetensors.torch import save_file

    torch.manual_seed(5)
    vae = WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)
    # ComfyUI's ops skip weight init (comfy.ops.disable_weight_init): set every tensor here
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif p.dim() > 1:
                p.normal_(0.0, (p[0].numel()) ** -0.5)
            else:
                p.zero_()
    save_file({k: v.detach().contiguous() for k, v in vae.state_dict().items()}, out_file)  # fp32


if __name__ == "__main__":
    main(*sys.argv[1:3])
