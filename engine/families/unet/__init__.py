"""U-Net families (SD 1.x / SDXL, Stable Cascade): one adapter per family."""
