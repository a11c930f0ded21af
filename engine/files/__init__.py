"""Files the engine writes and reads: atomic writes and checks of ``.safetensors`` files."""
