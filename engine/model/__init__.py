"""The model of a run: loading (diffusers folders, single files, presets), precision, attention
kernels, text encoders, LoRA files and FSDP2 sharding."""
