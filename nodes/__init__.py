"""ComfyUI node classes: thin adapters over ``engine/`` (the node pack is delivered by issue 3)."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
