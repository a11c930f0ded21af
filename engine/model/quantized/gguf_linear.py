"""A frozen ``nn.Linear`` over a GGUF-quantized weight, dequantized per call, never saved for backward.

The weight is a :class:`GGUFWeight`: diffusers' ``GGUFParameter`` (a ``torch.nn.Parameter``
subclass holding the file's raw blocks as ``uint8`` of shape ``(out, in / block * type_size)``
with its ``quant_type``; its ``__torch_function__`` keeps the type through the row splits and
concatenations of a layout conversion) that also survives ``copy.deepcopy``. :class:`GGUFLinear`
runs it through :class:`_FrozenGGUFLinear`, the pattern of ``QuantizedLinear``
(engine/model/precision.py): the quantized parameter is resident anyway, so the function keeps it
on its context instead of saving it, and backward dequantizes it again. So the dequantized weight
``(out, in)`` lives only while one layer's matmul runs (in forward, in a checkpoint's recompute and
in backward); checkpointing, offload and weight streaming see activations only.

Dequantization is diffusers' (``diffusers.quantizers.gguf.utils.dequantize_functions``, torch
ports of city96/ComfyUI-GGUF's ``dequant.py``, which follow ggml's block layouts), run in fp32
and rounded once to the layer's dtype: exact in fp32 for every block type here (each value is
``d * q`` or ``d * q - m`` of an fp16 scale and a small integer), one rounding in bf16/fp16
(diffusers' own ``GGUFLinear`` multiplies in fp16 when called without a dtype).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, GGUFParameter, dequantize_functions


class GGUFWeight(GGUFParameter):
    """diffusers' ``GGUFParameter`` that ``copy.deepcopy`` keeps quantized (``Parameter``'s own
    ``__deepcopy__`` rebuilds it without its ``quant_type``). Frozen: ``requires_grad`` is False.

    Attributes:
        quant_type: the ``gguf.GGMLQuantizationType``. quant_shape: the logical shape ``(out, in)``.
    """

    def __deepcopy__(self, memo: dict) -> GGUFWeight:
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.as_tensor().clone(), quant_type=self.quant_type)
        return memo[id(self)]


def is_gguf_weight(tensor: Any) -> bool:
    """Whether ``tensor`` holds GGUF blocks (a ``GGUFParameter``)."""
    return isinstance(tensor, GGUFParameter)


def dequantize(weight: GGUFParameter, dtype: torch.dtype) -> torch.Tensor:
    """The logical tensor of a GGUF weight: ``quant_shape`` (``(out, in)`` for a Linear), ``dtype``.

    Computed in fp32 (exact for the block types loaded here) and rounded once to ``dtype``.
    Transient memory: the fp32 result, plus the ``dtype`` copy when ``dtype`` is not fp32.
    """
    block, type_size = GGML_QUANT_SIZES[weight.quant_type]
    raw = weight.as_tensor().reshape(-1, type_size)  # (n_blocks, type_size) uint8; a view
    values = dequantize_functions[weight.quant_type](raw, block, type_size, dtype=torch.float32)
    return values.reshape(weight.quant_shape).to(dtype)


class _FrozenGGUFLinear(torch.autograd.Function):
    """``F.linear`` over a frozen GGUF weight that saves nothing for backward.

    Shapes: ``x (..., in) -> (..., out)``. ``grad_x = grad_out @ dequantize(W)``, ``W`` dequantized
    again in backward (after ``ready``, weight streaming's callable that brings it onto the device).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: GGUFParameter, bias: torch.Tensor | None, dtype: torch.dtype,
                ready: Any = None) -> torch.Tensor:
        ctx.weight, ctx.dtype, ctx.input_dtype, ctx.ready = weight, dtype, x.dtype, ready
        w = dequantize(weight, dtype)  # (out, in), freed when forward returns
        return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if ctx.ready is not None:
            ctx.ready()
        w = dequantize(ctx.weight, ctx.dtype)  # (out, in), transient
        return (grad_out.to(w.dtype) @ w).to(ctx.input_dtype), None, None, None, None


class GGUFLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen weight is a :class:`GGUFWeight` (its class swapped in place, so
    names and the state dict stay the Linear's); the bias, when present, is a plain tensor.

    Attributes:
        compute_dtype: what the weight dequantizes to and the matmul runs in (the run's storage
            dtype; fp32 in a module the model class keeps in fp32).
        weight_ready: set by weight streaming (engine/core/streaming.py) on a streamed block's
            layers: brings the weight onto the device before backward dequantizes it again.
    """

    compute_dtype = torch.float32
    weight_ready = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features) -> (..., out_features)``."""
        return _FrozenGGUFLinear.apply(x, self.weight, self.bias, self.compute_dtype, self.weight_ready)


def _weight_key(module_name: str) -> str:
    return f"{module_name}.weight" if module_name else "weight"


def _quantized_linear_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                           keep_fp32: Any = lambda name: False) -> list[str]:
    """Names of ``model``'s ``nn.Linear`` modules whose ``<name>.weight`` in ``tensors`` is a GGUF
    weight of the module's shape ``(out_features, in_features)`` (outside the modules
    ``keep_fp32(name)`` names, which the class keeps in full precision)."""
    names = []
    for name, module in model.named_modules():
        weight = tensors.get(_weight_key(name))
        if (type(module) is torch.nn.Linear and is_gguf_weight(weight) and not keep_fp32(name)
                and tuple(weight.quant_shape) == (module.out_features, module.in_features)):
            names.append(name)
    return names


def assign_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                   keep_fp32: Any = lambda name: False) -> int:
    """Make ``tensors`` (diffusers keys; plain tensors and GGUF weights) ``model``'s parameters.

    A GGUF weight of an ``nn.Linear`` stays quantized and its module becomes a :class:`GGUFLinear`;
    any other GGUF tensor (a conv kernel, a norm, a weight of a module kept in fp32) is dequantized
    to ``dtype`` here, one tensor at a time. The rest goes through ``load_state_dict(strict,
    assign=True)``, which checks every key and shape.

    Returns:
        The number of layers kept quantized.

    Raises:
        RuntimeError: keys missing or unexpected, or a shape differs (``load_state_dict``'s message).
    """
    names = _quantized_linear_names(model, tensors, keep_fp32)
    kept = {_weight_key(n) for n in names}
    plain = {k: v if k in kept or not is_gguf_weight(v) else dequantize(v, dtype) for k, v in tensors.items()}
    result = model.load_state_dict({k: v for k, v in plain.items() if k not in kept}, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - kept)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"missing keys {missing[:4]}, unexpected keys {sorted(result.unexpected_keys)[:4]}")
    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        module.__class__ = GGUFLinear
        module._parameters["weight"] = plain[_weight_key(name)]
        module.compute_dtype = dtype
    return len(names)
