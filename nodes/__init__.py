"""ComfyUI node classes: thin adapters over the engine's facade (``engine/api.py``), declared with
ComfyUI's V3 schema (``io.ComfyNode``; :mod:`.v3`) and handed to ComfyUI by :func:`comfy_entrypoint`."""

from ..engine import api
from .environment import in_comfyui
from .guardrail_nodes import FitGuardrails
from .model_nodes import ImageCaptionDataset, LoadDiffusionModel, LoRAConfig
from .noise_nodes import NoiseSchedule
from .planning_nodes import CheckpointingSweep, SchedulePlanner
from .report_nodes import LossGraph, RunReport
from .schedule_nodes import ActivationOffloadOptions, GradientCheckpointingSchedule, WeightOffloadOptions
from .training_nodes import SaveLoRA, TrainLoRA
from .v3 import ComfyExtension, io

NODES: list[type[io.ComfyNode]] = [
    LoadDiffusionModel, ImageCaptionDataset, GradientCheckpointingSchedule, ActivationOffloadOptions,
    WeightOffloadOptions, LoRAConfig, FitGuardrails, NoiseSchedule, TrainLoRA, SaveLoRA, LossGraph, RunReport,
    CheckpointingSweep, SchedulePlanner,
]
"""The pack's nodes, in the order of ComfyUI's node menu."""
NODE_CLASS_MAPPINGS = {cls.GET_SCHEMA().node_id: cls for cls in NODES}
"""The node classes by node id (``SegCkptTrainLoRA``, ...): what ``segckpt run`` and the routes look up."""


class SegmentedCheckpointingExtension(ComfyExtension):
    """The pack as a V3 extension: its node classes."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> SegmentedCheckpointingExtension:
    """What ComfyUI calls when it loads the pack (``nodes.py``, ``load_custom_node``): the extension,
    with the pack's HTTP routes registered on ComfyUI's server first (ComfyUI 0.3.64 does not call
    ``ComfyExtension.on_load``)."""
    if in_comfyui():
        with api.lazy_imports():
            from .routes import register_with_comfyui
        register_with_comfyui()
    return SegmentedCheckpointingExtension()
