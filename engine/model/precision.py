"""Precision of the frozen base and of the step's compute (SimpleTuner's ``base_model_precision``).

The frozen base is held in ``bf16`` (default on CUDA), ``fp16``, ``fp32`` (default on CPU), the
dtype its weight files store (``no_change``), or with its ``nn.Linear`` weights quantized
weight-only through torchao (``int8-torchao``, ``fp8-torchao``). The LoRA weights and the AdamW
state are always fp32; matmuls run in the compute dtype (bf16/fp16 autocast, or fp32).

A quantized Linear runs through :class:`QuantizedLinear`, whose autograd function keeps the
quantized parameter (already resident) for backward and dequantizes it again there: torchao's own
linear saves the dequantized full-precision weight of every call for backward, which would undo
the quantization for every block that is not checkpointed and hand the offload hooks a "weight"
to copy. Checkpointing, recompute and offload then see only activations, as with a plain base.
A GGUF model file's quantized layers (:class:`~.quantized.gguf_linear.GGUFLinear`) follow the same
pattern with the file's own blocks; the precision then sets the dtype they dequantize to (a torchao
precision over a GGUF file is refused by its config).

Rules and their sources: torchao's weight-only configs (``Int8WeightOnlyConfig``,
``Float8WeightOnlyConfig``; fp8 needs compute capability 8.9+ on CUDA per torchao's docs);
diffusers' ``_keep_in_fp32_modules`` stay fp32 and unquantized, as ``from_pretrained`` keeps them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.model import BASE_PRECISIONS, QUANTIZED
from ..core.memory import format_mib
from ..families.lazy import lazy_imports
from .distributed import local_tensor
from .quantized.gguf_linear import GGUFLinear

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class PrecisionError(ValueError):
    """A precision setting cannot run here; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class Precision:
    """The resolved precision of a run.

    Attributes:
        base: the applied ``base_model_precision`` (``auto`` resolved; ``no_change`` kept).
        storage_dtype: dtype of the base's floating weights that are not quantized (for a
            quantized base also the logical dtype its quantized weights dequantize to).
        compute_dtype: dtype the step's matmuls run in: the autocast dtype, or fp32.
    """

    base: str
    storage_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        """Whether the base's Linear weights are quantized."""
        return self.base in QUANTIZED

    @property
    def loss_scaling(self) -> bool:
        """fp16 compute needs dynamic loss scaling (``torch.amp.GradScaler``) against underflow."""
        return self.compute_dtype == torch.float16

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The step's autocast context (a no-op for fp32 compute)."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)

    def to_dict(self) -> dict[str, str]:
        """JSON-ready names (``{"base_model_precision": "bf16", "storage": "bf16", "compute": "bf16"}``)."""
        return {"base_model_precision": self.base, "storage": DTYPE_NAMES[self.storage_dtype],
                "compute": DTYPE_NAMES[self.compute_dtype]}


def resolve_precision(base_model_precision: str, mixed_precision: str, device: torch.device,
                      stored_dtype: torch.dtype = torch.float32) -> Precision:
    """The :class:`Precision` of a run on ``device``.

    Args:
        base_model_precision: one of :data:`BASE_PRECISIONS`.
        mixed_precision: ``auto`` (bf16 autocast on CUDA, fp16 for an fp16 base; on the CPU the
            base's dtype: fp32, or bf16/fp16 autocast for a bf16/fp16 base), ``bf16`` or ``fp32``.
        device: where the step runs.
        stored_dtype: the dtype the weight files hold (used by ``no_change``).

    Raises:
        PrecisionError: fp32 compute over a bf16/fp16 base (its weights cannot enter fp32
            matmuls without autocast), fp8 on a CUDA device below compute capability 8.9, or an
            unknown value.
    """
    base = base_model_precision
    if base not in BASE_PRECISIONS:
        raise PrecisionError(f"base_model_precision={base!r} is invalid: allowed {', '.join(BASE_PRECISIONS)}.")
    if base == "auto":
        base = "bf16" if device.type == "cuda" else "fp32"
    storage = stored_dtype if base == "no_change" else DTYPES.get(base)  # None: quantized, decided below
    if storage is not None and storage not in DTYPE_NAMES:
        raise PrecisionError(f"base_model_precision=no_change: the weights are stored as {storage}; allowed "
                             "for no_change: bf16, fp16 or fp32 files (choose a precision to convert to)")
    if mixed_precision == "fp32":
        if storage in (torch.bfloat16, torch.float16):
            raise PrecisionError(
                f"mixed_precision=fp32 is invalid with base_model_precision={base_model_precision!r} "
                f"({DTYPE_NAMES[storage]} weights): allowed bf16/auto mixed precision, or a base precision of "
                "fp32, int8-torchao or fp8-torchao")
        compute = torch.float32
    elif mixed_precision == "bf16":
        compute = torch.bfloat16
    elif device.type == "cuda":
        compute = torch.float16 if storage == torch.float16 else torch.bfloat16
    else:
        compute = storage if storage in (torch.bfloat16, torch.float16) else torch.float32
    if base == "fp8-torchao" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise PrecisionError(
                f"base_model_precision=fp8-torchao is invalid on {torch.cuda.get_device_name(device)} (compute "
                f"capability {capability[0]}.{capability[1]}): fp8 needs 8.9 or newer (Ada, Hopper); allowed "
                "here: int8-torchao, bf16, fp16, fp32")
    return Precision(base, storage if storage is not None else compute, compute)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``F.linear`` over a frozen quantized weight that saves nothing for backward.

    Shapes: ``x (..., in) -> (..., out)``. The weight is a parameter (alive anyway), kept on the
    context object rather than saved, so no saved-tensor hook (checkpoint, offload) sees it;
    backward dequantizes it again: ``grad_x = grad_out @ dequantize(W)``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                ready: Any = None) -> torch.Tensor:
        ctx.weight, ctx.input_dtype, ctx.ready = weight, x.dtype, ready
        return F.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if ctx.ready is not None:  # a streamed weight: bring it onto the device again
            ctx.ready()
        weight = ctx.weight.dequantize()  # (out, in), transient
        return (grad_out.to(weight.dtype) @ weight).to(ctx.input_dtype), None, None, None


class QuantizedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen weight is a torchao weight-only quantized tensor.

    Same parameters and state-dict names as the Linear it was made from (its class is swapped in
    place on our training copy); computes in the weight's logical dtype. ``weight_ready``: set by
    weight streaming (engine/core/streaming.py) on the layers of a streamed block, a callable that
    brings the weight onto the device before backward reads it again.
    """

    weight_ready = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features) -> (..., out_features)``."""
        return _FrozenQuantizedLinear.apply(x, self.weight, self.bias, self.weight_ready)


@dataclass(frozen=True)
class BaseWeights:
    """What :func:`apply_base_precision` left in the model.

    Attributes:
        linear_layers: ``nn.Linear`` modules of the base (LoRA layers are added later).
        quantized_linear_layers: how many of them hold a quantized weight (torchao's, or a GGUF
            file's :class:`~.quantized.gguf_linear.GGUFLinear`).
        frozen_bytes: bytes of the frozen parameters and buffers (quantized: data + scales).
    """

    linear_layers: int
    quantized_linear_layers: int
    frozen_bytes: int


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; for a wrapper subclass (torchao) the sum of its inner tensors; for a
    DTensor (FSDP) this process's shard."""
    tensor = local_tensor(tensor)
    if is_traceable_wrapper_subclass(tensor):
        return sum(tensor_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


def frozen_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that do not require grad, plus every buffer."""
    return (sum(tensor_bytes(p) for p in model.parameters() if not p.requires_grad)
            + sum(tensor_bytes(b) for b in model.buffers()))


def _keep_fp32(model: torch.nn.Module) -> list[str]:
    return list(getattr(model, "_keep_in_fp32_modules", None) or ())


def _in_keep(name: str, keep: list[str]) -> bool:
    parts = name.split(".")
    return any(k in parts or name == k or name.startswith(k + ".") for k in keep)


def keeps_fp32(model: torch.nn.Module) -> Callable[[str], bool]:
    """``name -> whether the module of that name is one the class keeps in fp32``
    (``_keep_in_fp32_modules``: never quantized, stored in fp32)."""
    keep = _keep_fp32(model)
    return lambda name: _in_keep(name, keep)


def host_parameters(modules: list[torch.nn.Module]) -> set[int]:
    """``id`` of the frozen parameters of ``modules`` (what :func:`move_to` keeps on the host)."""
    return {id(p) for m in modules for p in m.parameters() if not p.requires_grad}


def move_to(model: torch.nn.Module, device: torch.device, keep: set[int] = frozenset()) -> torch.nn.Module:
    """``model.to(device)`` except the parameters whose ``id`` is in ``keep``: the frozen weights of
    the blocks that stream from host memory stay there (they never have to fit on the device)."""
    if not keep:
        return model.to(device)
    for module in model.modules():
        module._apply(lambda t: t if id(t) in keep else t.to(device), recurse=False)
    return model


def apply_base_precision(model: torch.nn.Module, precision: Precision, device: torch.device,
                         host_modules: list[torch.nn.Module] = ()) -> BaseWeights:
    """Bring the frozen base of ``model`` to ``precision`` on ``device`` (idempotent).

    Floating parameters and buffers go to ``precision.storage_dtype`` (modules the class lists
    in ``_keep_in_fp32_modules`` stay fp32); for a quantized precision every other ``nn.Linear``
    is quantized weight-only, one layer at a time on ``device`` (the full-precision base never
    has to fit on the device at once), and becomes a :class:`QuantizedLinear`. Call it before
    the LoRA is added: LoRA layers are never quantized.

    Args:
        host_modules: blocks whose frozen weights stream from host memory (``weight_offload``):
            quantized one block at a time on ``device`` and brought back to the host, and not
            moved to the device.

    Raises:
        PrecisionError: torchao is not installed for a quantized precision.
    """
    model.requires_grad_(False)  # the frozen base: the LoRA added afterwards is what trains
    keep = _keep_fp32(model)
    for name, module in model.named_modules():
        dtype = torch.float32 if _in_keep(name, keep) else precision.storage_dtype
        if isinstance(module, GGUFLinear):  # a GGUF file's layer: its weight stays quantized
            module.compute_dtype = dtype
        for key, value in list(module._parameters.items()) + list(module._buffers.items()):
            if value is not None and value.is_floating_point() and not is_traceable_wrapper_subclass(value) \
                    and value.dtype != dtype:
                with torch.no_grad():
                    value.data = value.data.to(dtype)
    if precision.quantized:
        quantize, config = _torchao(precision.base)

        names = {id(m): n for n, m in model.named_modules()}

        def wanted(module: torch.nn.Module, name: str) -> bool:
            return (type(module) is torch.nn.Linear and not is_traceable_wrapper_subclass(module.weight)
                    and not _in_keep(names.get(id(module), name), keep))

        with quiet_torchao():
            for block in host_modules:  # one block on the device at a time, then back to the host
                quantize(block, config, filter_fn=wanted, device=device)
                block.to("cpu")
            quantize(model, config, filter_fn=wanted, device=device)
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and is_traceable_wrapper_subclass(module.weight):
                module.__class__ = QuantizedLinear
    quantized = sum(1 for m in model.modules() if isinstance(m, (QuantizedLinear, GGUFLinear)))
    move_to(model, device, host_parameters(host_modules))
    linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    return BaseWeights(linear, quantized, frozen_bytes(model))


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """Silence what torchao logs and warns about itself on import and use (prebuilt kernels for
    other torch builds, pytree registration notes); our report counts what was quantized."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="torchao")
            # peft's LoRA over a torchao layer can train but not merge; we never merge
            warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao(base: str) -> tuple[Any, Any]:
    """``(quantize_, config)`` of a quantized precision.

    Raises:
        PrecisionError: torchao is not importable.
    """
    try:
        with lazy_imports(), quiet_torchao():
            from torchao.quantization import (
                Float8WeightOnlyConfig,
                Int8WeightOnlyConfig,
                quantize_,
            )
    except ImportError as exc:
        raise PrecisionError(f"base_model_precision={base!r} needs torchao ({exc}): pip install "
                             "'comfyui-segmented-checkpointing[quantization]', or choose bf16, fp16 or fp32") from exc
    return quantize_, (Int8WeightOnlyConfig() if base == "int8-torchao" else Float8WeightOnlyConfig())


def check_torchao(base_model_precision: str) -> None:
    """Fail early when a quantized precision is asked for and torchao is missing.

    Raises:
        PrecisionError: see :func:`_torchao`.
    """
    if base_model_precision in QUANTIZED:
        _torchao(base_model_precision)


def describe_precision(precision: Precision, base: BaseWeights, kernels: tuple[str, ...]) -> str:
    """The run's one log line on its base precision, frozen bytes, compute dtype and SDPA kernels."""
    quantized = (f", {base.quantized_linear_layers}/{base.linear_layers} Linear layers quantized"
                 + ("" if precision.quantized else " (GGUF, dequantized per layer)")
                 if base.quantized_linear_layers else "")
    return (f"base: {precision.base} ({format_mib(base.frozen_bytes, 1)} frozen weights{quantized}), compute "
            f"{precision.to_dict()['compute']}, LoRA fp32; attention kernels {','.join(kernels)}")
