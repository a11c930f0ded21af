"""The nodes that choose how activations and frozen weights are kept: Gradient Checkpointing
Schedule, Activation Offload Options and Weight Offload Options."""

from __future__ import annotations

from ..engine import api
from .environment import node_error, public_errors
from .payloads import CATEGORY, FamilySchedule, OffloadOptions, Sockets, WeightOffload
from .v3 import io
from .widgets import NodeOptions, widget

_KEYS = ("gradient_checkpointing", "gradient_checkpointing_backend", "gradient_checkpointing_interval",
         "gradient_checkpointing_segment_stride", "gradient_checkpointing_offload_attention",
         "gradient_checkpointing_offload_pin_memory_max_buckets")
_OFFLOAD = _KEYS[1:2] + _KEYS[4:]
_SAVE = "gradient_checkpointing_save_attention"
"""Optional on the Schedule node (workflows saved before it leave it out)."""
_STREAM = ("weight_offload", "weight_offload_blocks", "weight_offload_prefetch")


class GradientCheckpointingSchedule(io.ComfyNode):
    """The six gradient-checkpointing keys (SimpleTuner names) for one family; 0 = unset for
    interval and stride. Outputs a :class:`~.payloads.FamilySchedule`."""

    OPTIONS = NodeOptions({key: key for key in _KEYS + (_SAVE,)}, zero_unset=_KEYS[2:4])

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptSchedule", display_name="Gradient Checkpointing Schedule", category=CATEGORY,
                         inputs=[widget("family", tooltip="Family this schedule is for: the block strip shows its "
                                        "plan, and a backend the family cannot run is refused when the prompt is "
                                        "queued. Train LoRA refuses a model of another family."),
                                 *[widget(key, extra=" 0 = unset." if key in cls.OPTIONS.zero_unset else "",
                                          zero_unset=key in cls.OPTIONS.zero_unset) for key in _KEYS],
                                 widget(_SAVE, optional=True)],
                         outputs=[Sockets.schedule.Output(display_name="schedule")])

    @classmethod
    def schedule(cls, family: str | None = None, **keys) -> api.CheckpointSchedule:
        """The :class:`~..engine.config.schedule.CheckpointSchedule` of the node's widget values (0 = unset), checked against
        ``family``'s boundaries when it is given.

        Raises:
            ScheduleError: a key is invalid, or the family cannot run it.
        """
        if family is None:
            return api.CheckpointSchedule(**cls.OPTIONS.values(keys))
        # the node's keys over the schedule's own defaults (not the demo schedule of a run)
        return cls.OPTIONS.config(keys, api.TrainConfig(schedule=api.CheckpointSchedule()), family=family).schedule

    @classmethod
    def validate_inputs(cls, family=None, **keys):
        # ComfyUI skips its own checks of the inputs a validator takes: the config's validator
        # checks them all (and the keys that can be wrong together). Raised, not returned: a
        # returned message would be listed once per input, a raised one once for this node.
        try:
            cls.schedule(family, **keys)
        except (ValueError, KeyError) as exc:
            raise node_error(exc) from None
        return True

    @classmethod
    @public_errors
    def execute(cls, family, **keys):
        return io.NodeOutput(FamilySchedule(family, cls.schedule(family, **keys)))


class ActivationOffloadOptions(io.ComfyNode):
    """Offload options that override the schedule's when connected to Train LoRA."""

    OPTIONS = NodeOptions({key: key for key in _OFFLOAD})
    DEFAULTS = {"gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True}
    """This node's defaults: offloading on (the schedule's own defaults keep it off)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptOffloadOptions", display_name="Activation Offload Options", category=CATEGORY,
                         inputs=[widget(key, **({"default": cls.DEFAULTS[key]} if key in cls.DEFAULTS else {}))
                                 for key in _OFFLOAD],
                         outputs=[Sockets.offload.Output(display_name="offload")])

    @classmethod
    def validate_inputs(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @classmethod
    @public_errors
    def execute(cls, **keys):
        return io.NodeOutput(OffloadOptions(**keys))


class WeightOffloadOptions(io.ComfyNode):
    """Weight-streaming options that override the schedule's when connected to Train LoRA: the frozen
    weights of some or all blocks live in host memory and are copied to the device before each use.
    0 = all blocks for ``weight_offload_blocks``. Outputs a :class:`~.payloads.WeightOffload`."""

    OPTIONS = NodeOptions({key: key for key in _STREAM}, zero_unset=_STREAM[1:2])
    DEFAULTS = {"weight_offload": "stream"}
    """This node's defaults: streaming on (the schedule's own default keeps every weight resident)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="SegCkptWeightOffload", display_name="Weight Offload Options (stream frozen weights)",
                         category=CATEGORY,
                         inputs=[widget(key, extra=" 0 = all." if key in cls.OPTIONS.zero_unset else "",
                                        zero_unset=key in cls.OPTIONS.zero_unset,
                                        **({"default": cls.DEFAULTS[key]} if key in cls.DEFAULTS else {}))
                                 for key in _STREAM],
                         outputs=[Sockets.weight_offload.Output(display_name="weight_offload")])

    @classmethod
    def validate_inputs(cls, **inputs):
        return cls.OPTIONS.validate(inputs)

    @classmethod
    @public_errors
    def execute(cls, **keys):
        return io.NodeOutput(WeightOffload(**cls.OPTIONS.values(keys)))


__all__ = ["ActivationOffloadOptions", "GradientCheckpointingSchedule", "WeightOffloadOptions"]
