"""The non-finite guard: after backward, before the optimizer step, one check of the loss and
every LoRA gradient (one device synchronisation), and advice that fits the cause.

The check stacks one ``isfinite().all()`` flag per gradient tensor with the loss and reads them
in one transfer, so it can name the first LoRA module whose gradient is not finite without a
second pass. It runs before ``optimizer.step()``: a NaN never reaches the LoRA weights, the saved
state or the LoRA file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..model.distributed import local_tensor
from ..model.lora_header import KINDS


class TrainingStopped(ValueError):
    """A step could not be applied; the run stops after saving its last good step."""


class TrainingDiverged(TrainingStopped):
    """The loss or a LoRA gradient became NaN or infinite; nothing of that step was applied."""


@dataclass(frozen=True)
class FiniteCheck:
    """Result of :func:`check_finite`.

    Attributes:
        loss: the step's loss (mean over micro-batches; may be NaN/inf).
        loss_finite: whether it is finite.
        bad_module: the first LoRA module (model order) with a non-finite gradient, or None.
        grad_norm: the gradients' total L2 norm before clipping (read in the same transfer), or None.
    """

    loss: float
    loss_finite: bool
    bad_module: str | None
    grad_norm: float | None = None

    @property
    def ok(self) -> bool:
        """Loss and every gradient finite."""
        return self.loss_finite and self.bad_module is None


def lora_module_name(parameter_name: str) -> str:
    """``blocks.0.attn.to_k.lora_B.default.weight`` -> ``blocks.0.attn.to_k (lora_B)``; the same for
    every adapter tensor (``lokr_w1``, ``hada_w2_b``, ``lora_magnitude_vector``: ``engine/model/lora_header.py``)."""
    for kind in KINDS.values():
        for tensor in kind.tensors:
            part = "." + tensor.removesuffix(".weight") + "."
            if part in parameter_name:
                return f"{parameter_name.partition(part)[0]} ({part.strip('.')})"
    return parameter_name


def check_finite(loss: torch.Tensor, named_params: list[tuple[str, torch.nn.Parameter]],
                 all_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 grad_norm: torch.Tensor | None = None) -> FiniteCheck:
    """Check ``loss`` (0-d) and the ``.grad`` of every parameter with one synchronisation.

    Parameters without a gradient count as finite. Sharded gradients (FSDP's DTensors) are checked
    shard by shard; ``all_ranks`` (:meth:`~..model.distributed.Distributed.all_true`) then combines
    the flags of every rank, so that all ranks take the same decision (``loss`` must already be
    the mean over ranks). ``grad_norm`` (0-d, the same on every rank) is read in the same transfer.
    """
    graded = [(n, local_tensor(p.grad)) for n, p in named_params if p.grad is not None]
    head = [loss.detach().float().reshape(())]
    if grad_norm is not None:
        head.append(grad_norm.float().reshape(()).to(loss.device))
    flags = torch.stack(head + [g.isfinite().all().float() for _, g in graded])
    if all_ranks is not None and len(flags) > len(head):
        flags = torch.cat([flags[:len(head)], all_ranks(flags[len(head):])])
    values = flags.tolist()  # the one synchronisation
    (loss_value, *norm), finite = values[:len(head)], values[len(head):]
    bad = next((graded[i][0] for i, v in enumerate(finite) if v == 0.0), None)
    return FiniteCheck(loss_value, math.isfinite(loss_value), lora_module_name(bad) if bad else None,
                       norm[0] if norm else None)


def describe(check: FiniteCheck, step: int, context: dict) -> str:
    """One line: what was not finite, where, under which precision and kernels, and what to do.

    Args:
        check: the failed check.
        step: 1-based optimizer step.
        context: ``device``, ``precision`` (:meth:`~..model.precision.Precision.to_dict`),
            ``attention_backend`` (kernel names), ``learning_rate``, ``lora_alpha``, ``lora_rank``.
    """
    what = (f"loss is {check.loss}" if not check.loss_finite
            else f"loss {check.loss:.4g} is finite but a LoRA gradient is not")
    where = f"; first LoRA module with a non-finite gradient: {check.bad_module}" if check.bad_module else ""
    p = context["precision"]
    setting = (f"base_model_precision={p['base_model_precision']} (compute {p['compute']}), "
               f"attention_backend={','.join(context['attention_backend'])} on {context['device']}")
    return f"non-finite values at step {step}: {what}{where} [{setting}]. {advice(check, step, context)}"


def advice(check: FiniteCheck, step: int, context: dict) -> str:
    """What most likely caused a failed check, from what was non-finite and the run's settings."""
    compute = context["precision"]["compute"]
    kernels, cuda = context["attention_backend"], str(context["device"]).startswith("cuda")
    if check.loss_finite:  # forward fine, backward not: a kernel or range problem, not the lr
        if cuda and "cudnn" in kernels:
            return ("cuDNN's fused attention backward returns NaN for some shapes (pytorch/pytorch#196678): "
                    "use --attention-backend auto, which leaves cuDNN out.")
        if compute == "fp16":
            return "fp16 overflowed in backward: use --base-precision bf16 (or fp32)."
        return ("the backward pass produced it from a finite loss, so lowering the learning rate will not help: "
                "try --attention-backend math to rule out the attention kernel, and report this line.")
    if compute == "fp16":
        return "fp16 overflowed in forward: use --base-precision bf16 (or fp32)."
    if step == 1:
        return ("the first step's loss is not finite before any update: check the model weights and the "
                "data (a damaged weight file, an all-NaN latent).")
    scale = context["lora_alpha"] / context["lora_rank"]
    return (f"training diverged: lower the learning rate (now {context['learning_rate']}) or lora_alpha "
            f"(now {context['lora_alpha']}, update scale alpha/rank = {scale:g}).")
