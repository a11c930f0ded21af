"""Quantized single files as a frozen base: ComfyUI's scaled fp8 safetensors (dequantized as read)
and city96's GGUF files (kept quantized, dequantized per layer in forward and backward)."""
