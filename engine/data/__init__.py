"""The training data of a run: image folders, images, aspect-ratio buckets, ComfyUI's prepared
latents, the latent cache and the samplers."""
