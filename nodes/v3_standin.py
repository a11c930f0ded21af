"""A stand-in for the part of ComfyUI's V3 node API (``comfy_api.v0_0_2.io``) that the pack's nodes
use, so that they run without ComfyUI (``segckpt run``, the tests): the same names and arguments,
and the same V1 rendering (``GET_NODE_INFO_V1``, what ComfyUI's ``/object_info`` serves, and
``INPUT_TYPES``). Inside ComfyUI the nodes use ComfyUI's own (:mod:`.v3`).

What the pack uses and this holds: ``Schema``; ``ComfyNode`` (``define_schema``, ``execute``,
``validate_inputs``, ``fingerprint_inputs``, ``hidden`` and ``PREPARE_CLASS_CLONE``); the input and
output types ``Boolean``, ``Int``, ``Float``, ``String``, ``Combo``, ``Image``, ``Latent``,
``Conditioning``, ``Vae``, ``AnyType`` and ``Custom(io_type)``; ``Hidden``; ``NodeOutput``; and
``ComfyExtension``. A keyword the real type does not take is refused here too (``TypeError``).
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import Any


def _pruned(values: dict) -> dict:
    return {key: value for key, value in values.items() if value is not None}


class Hidden(str, enum.Enum):
    """The hidden inputs a node can ask for (their V1 type names as values)."""

    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"


class HiddenHolder:
    """A node's hidden values by name (``cls.hidden.unique_id``); ``None`` for one not given."""

    def __init__(self, values: dict[Hidden, Any]):
        self.__dict__.update({Hidden(key).name: value for key, value in values.items()})

    def __getattr__(self, name: str) -> Any:
        return None

    @classmethod
    def from_dict(cls, values: dict | None) -> HiddenHolder:
        return cls(values or {})


class Input:
    """One declared input: ``id``, whether it is optional, and its options as V1 renders them."""

    def __init__(self, io_type: str, id: str, optional: bool, options: dict):
        self.io_type, self.id, self.optional, self.options = io_type, id, optional, _pruned(options)

    def get_io_type(self) -> str:
        return self.io_type

    def as_dict(self) -> dict:
        return dict(self.options)


class Output:
    """One declared output: ``id``, ``display_name`` (its name on the node), ``tooltip``."""

    def __init__(self, io_type: str, id: str | None = None, display_name: str | None = None,
                 tooltip: str | None = None, is_output_list: bool = False):
        self.io_type, self.id, self.display_name = io_type, id, display_name
        self.tooltip, self.is_output_list = tooltip, is_output_list


class _Type:
    """A V3 type: ``.Input(id, ...)`` and ``.Output(...)`` with the keywords the real type takes.

    Args:
        io_type: the type's name. widget: its widget keywords and their defaults (``None``:
            left out of the rendering unless given).
    """

    def __init__(self, io_type: str, **widget: Any):
        self.io_type, self.widget = io_type, widget

    def Input(self, id: str, display_name: str | None = None, optional: bool = False, tooltip: str | None = None,
              lazy: bool | None = None, **given: Any) -> Input:
        unknown = set(given) - set(self.widget)
        if unknown:
            raise TypeError(f"{self.io_type} input {id!r}: unexpected keyword {sorted(unknown)[0]!r}")
        return Input(self.io_type, id, optional, {"display_name": display_name, "tooltip": tooltip, "lazy": lazy,
                                                  **self.widget, **given})

    def Output(self, id: str | None = None, display_name: str | None = None, tooltip: str | None = None,
               is_output_list: bool = False) -> Output:
        return Output(self.io_type, id, display_name, tooltip, is_output_list)


class _Combo(_Type):
    def Input(self, id: str, options: list | None = None, display_name: str | None = None, optional: bool = False,
              tooltip: str | None = None, lazy: bool | None = None, default: Any = None) -> Input:
        return super().Input(id, display_name, optional, tooltip, lazy, default=default, options=options)


def Custom(io_type: str) -> _Type:
    """The type of a custom socket (``SEGCKPT_MODEL``, ...): no widget."""
    return _Type(io_type)


_NUMBER = {"default": None, "min": None, "max": None, "step": None}
Boolean = _Type("BOOLEAN", default=None)
Int = _Type("INT", **_NUMBER)
Float = _Type("FLOAT", **_NUMBER)
String = _Type("STRING", default=None, multiline=False, placeholder=None)
Combo = _Combo("COMBO", default=None, multiselect=False, options=None)
Image, Latent, Conditioning, Vae, AnyType = (Custom(name) for name in ("IMAGE", "LATENT", "CONDITIONING", "VAE", "*"))


@dataclasses.dataclass
class Schema:
    """A node's declaration: id, title, menu category, inputs, outputs, hidden inputs."""

    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list[Input] | None = None
    outputs: list[Output] | None = None
    hidden: list[Hidden] | None = None
    description: str = ""
    is_output_node: bool = False
    not_idempotent: bool = False

    def finalize(self) -> None:
        """An output node also gets the prompt and its PNG info; an output without id gets one."""
        if self.is_output_node:
            self.hidden = (self.hidden or []) + [h for h in (Hidden.prompt, Hidden.extra_pnginfo)
                                                 if h not in (self.hidden or [])]
        for index, output in enumerate(self.outputs or []):
            output.id = output.id or f"_{index}_{output.io_type}_"

    def get_v1_info(self, cls: type) -> dict:
        """The node as ComfyUI's ``/object_info`` lists it."""
        inputs: dict[str, dict] = {"required": {}}
        for spec in self.inputs or []:
            inputs.setdefault("optional" if spec.optional else "required", {})[spec.id] = (spec.get_io_type(),
                                                                                           spec.as_dict())
        for hidden in self.hidden or []:
            inputs.setdefault("hidden", {})[hidden.name] = (hidden.value,)
        outputs = self.outputs or []
        return {"input": inputs, "input_order": {key: list(value) for key, value in inputs.items()},
                "output": [o.io_type for o in outputs], "output_is_list": [o.is_output_list for o in outputs],
                "output_name": [o.display_name or o.io_type for o in outputs],
                "output_tooltips": [o.tooltip or None for o in outputs], "name": self.node_id,
                "display_name": self.display_name, "description": self.description,
                "python_module": getattr(cls, "RELATIVE_PYTHON_MODULE", "nodes"), "category": self.category,
                "output_node": self.is_output_node, "deprecated": False, "experimental": False, "api_node": False}


class NodeOutput:
    """What ``execute`` returns: the output values (``result``, indexable) and what the page shows (``ui``)."""

    def __init__(self, *args: Any, ui: dict | None = None):
        self.args, self.ui = args, ui

    @property
    def result(self) -> tuple | None:
        return self.args if self.args else None

    def __getitem__(self, index: int) -> Any:
        return self.args[index]


class ComfyNode:
    """The base of a V3 node: ``define_schema`` and ``execute`` classmethods; ``validate_inputs``
    and ``fingerprint_inputs`` when the node defines them (``v3.overridden``)."""

    RELATIVE_PYTHON_MODULE = None
    hidden: HiddenHolder | None = None

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> NodeOutput:
        raise NotImplementedError

    @classmethod
    def validate_inputs(cls, **kwargs: Any) -> bool:
        raise NotImplementedError

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def GET_SCHEMA(cls) -> Schema:
        schema = cls.define_schema()
        schema.finalize()
        return schema

    @classmethod
    def GET_NODE_INFO_V1(cls) -> dict:
        return cls.GET_SCHEMA().get_v1_info(cls)

    @classmethod
    def INPUT_TYPES(cls, include_hidden: bool = True) -> dict:
        inputs = cls.GET_NODE_INFO_V1()["input"]
        return inputs if include_hidden else {k: v for k, v in inputs.items() if k != "hidden"}

    @classmethod
    def PREPARE_CLASS_CLONE(cls, hidden_inputs: dict) -> type:
        """A copy of the class whose ``hidden`` holds ``hidden_inputs`` (``{Hidden.unique_id: ...}``)."""
        return type(f"{cls.__name__}Clone", (cls,), {"hidden": HiddenHolder.from_dict(hidden_inputs)})


class ComfyExtension(ABC):
    """What a pack's ``comfy_entrypoint`` returns: its node classes."""

    async def on_load(self) -> None:
        """Called when the extension is loaded (not by ComfyUI 0.3.64)."""

    @abstractmethod
    async def get_node_list(self) -> list[type[ComfyNode]]:
        """The pack's node classes."""
