"""ComfyUI node classes: thin adapters over the engine's facade (``engine/api.py``)."""

from .guardrail_nodes import FitGuardrails
from .model_nodes import ImageCaptionDataset, LoadDiffusionModel, LoRAConfig
from .noise_nodes import NoiseSchedule
from .planning_nodes import CheckpointingSweep, SchedulePlanner
from .report_nodes import LossGraph, RunReport
from .schedule_nodes import ActivationOffloadOptions, GradientCheckpointingSchedule, WeightOffloadOptions
from .training_nodes import SaveLoRA, TrainLoRA

_NODES = {
    "SegCkptLoadDiffusionModel": (LoadDiffusionModel, "Load Diffusion Model (gradient checkpointing)"),
    "SegCkptImageCaptionDataset": (ImageCaptionDataset, "Image+Caption Dataset"),
    "SegCkptSchedule": (GradientCheckpointingSchedule, "Gradient Checkpointing Schedule"),
    "SegCkptOffloadOptions": (ActivationOffloadOptions, "Activation Offload Options"),
    "SegCkptWeightOffload": (WeightOffloadOptions, "Weight Offload Options (stream frozen weights)"),
    "SegCkptLoRAConfig": (LoRAConfig, "LoRA Config"),
    "SegCkptFitGuardrails": (FitGuardrails, "Fit Guardrails (pre-flight, OOM recovery, watchdog)"),
    "SegCkptNoiseSchedule": (NoiseSchedule, "Noise Schedule (timesteps, shift, loss weighting, guidance)"),
    "SegCkptTrainLoRA": (TrainLoRA, "Train LoRA (gradient checkpointing)"),
    "SegCkptSaveLoRA": (SaveLoRA, "Save LoRA"),
    "SegCkptLossGraph": (LossGraph, "Loss Graph"),
    "SegCkptRunReport": (RunReport, "Run Report"),
    "SegCkptSweep": (CheckpointingSweep, "Checkpointing Sweep"),
    "SegCkptSchedulePlanner": (SchedulePlanner, "Schedule Planner"),
}
NODE_CLASS_MAPPINGS = {name: cls for name, (cls, _) in _NODES.items()}
NODE_DISPLAY_NAME_MAPPINGS = {name: title for name, (_, title) in _NODES.items()}

from .environment import in_comfyui as _in_comfyui

if _in_comfyui():
    from .routes import register_with_comfyui

    register_with_comfyui()
