"""Per-rank peak on N processes, DDP against FSDP2 (``segckpt plan --nproc N``).

From the planner's probe (:class:`~.probe.Probe`) and the schedule it chose for one process:

* **DDP** (``ddp``, :func:`~..model.distributed.replicate`): every rank holds a whole
  replica and runs the chosen schedule as one process does (streaming included), and
  ``DistributedDataParallel`` (``gradient_as_bucket_view`` off, its default) copies the LoRA
  gradients into bucket buffers of their size: per-rank peak = the predicted peak + the LoRA
  gradient bytes (the blocks' ``grad``).
* **FSDP2** (``fsdp``, :func:`~..model.distributed.shard_model`: ``fully_shard`` on every block, then the root): the
  chosen checkpointing mode without what ``fsdp`` refuses (weight streaming, attention offload;
  ``engine/config/train.py``), each block's frozen weights, LoRA and optimizer state held as one
  N-th, and a block's full parameters gathered while it runs with the next one prefetched
  (FSDP2's default): per-rank peak = that mode's predicted peak - (frozen + LoRA + optimizer state)
  x (1 - 1/N) + 2 x the largest block's frozen + LoRA bytes. The gradients are left whole: the
  predicted peak holds only the later blocks' at the block where it is reached, and for a LoRA they
  are a few MB; the root's own weights (embedders, final layer) are sharded too but counted
  whole. Both leave the estimate on the high side.

DDP is recommended when its per-rank peak fits the budget with the planner's headroom
(:data:`~.planner.MARGIN`): for LoRA it is the faster of the two (README "Several GPUs").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .planner import MARGIN, Prediction, predict
from .probe import Probe


@dataclass
class RankPeaks:
    """Per-rank predicted peaks on ``nproc`` processes and the recommendation.

    Attributes:
        nproc: processes (>= 2). budget_bytes: the device budget, bytes.
        ddp_peak_bytes / fsdp_peak_bytes: predicted per-rank peaks, bytes.
        fsdp_mode: the checkpointing mode the FSDP2 figure is for (the chosen one, resident).
        recommended: ``ddp`` or ``fsdp``. reason: why, in words.
    """

    nproc: int
    budget_bytes: int
    ddp_peak_bytes: int
    fsdp_peak_bytes: int
    fsdp_mode: str
    recommended: str
    reason: str

    def render(self) -> str:
        """One line with both figures, the budget and the recommendation with its reason."""
        gib = 2**30
        return (f"{self.nproc} processes, per-rank peak predicted: DDP {self.ddp_peak_bytes / gib:.4g} GiB, "
                f"FSDP2 {self.fsdp_peak_bytes / gib:.4g} GiB ({self.fsdp_mode}); budget {self.budget_bytes / gib:.4g}"
                f" GiB; recommended: {'--ddp' if self.recommended == 'ddp' else '--fsdp'} ({self.reason})")

    def to_dict(self) -> dict:
        """The fields as a JSON-ready mapping."""
        return asdict(self)


def check_nproc(nproc: object, key: str = "--nproc") -> int:
    """``nproc`` as an int >= 1.

    Raises:
        ValueError: not an integer >= 1 (a bool is not one); the message names ``key``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"{key}={nproc!r} is invalid: allowed an integer >= 1 (processes per node under torchrun)")
    return nproc


def rank_peaks(probe_: Probe, chosen: Prediction, budget_bytes: int, nproc: int,
               margin: float = MARGIN) -> RankPeaks | None:
    """Predict the per-rank peak of ``chosen`` under DDP and FSDP2 on ``nproc`` processes (see
    the module docstring); None for one process.

    Args:
        probe_: the planner's probe. chosen: the planner's choice for one process.
        budget_bytes: the device budget, bytes. nproc: processes. margin: the planner's headroom.

    Raises:
        ValueError: ``nproc`` is not an integer >= 1.
    """
    if check_nproc(nproc) == 1:
        return None
    blocks = [(probe_.frozen_block_bytes.get(name, [0] * len(costs))[i], c.grad,
               probe_.optimizer_block_bytes.get(name, [0] * len(costs))[i])
              for name, costs in probe_.blocks.items() for i, c in enumerate(costs)]
    lora = sum(grad for _, grad, _ in blocks)
    ddp = chosen.peak_bytes + lora
    schedule = chosen.schedule
    if schedule.streams or schedule.gradient_checkpointing_offload_attention:
        schedule = schedule.replace(weight_offload="none", weight_offload_blocks=None,
                                    gradient_checkpointing_offload_attention=False)
    sharded = sum(frozen + grad + state for frozen, grad, state in blocks)
    gathered = 2 * max((frozen + grad for frozen, grad, _ in blocks), default=0)
    fsdp = predict(probe_, schedule).peak_bytes - sharded * (nproc - 1) // nproc + gathered
    limit = budget_bytes * (1 - margin)
    if ddp <= limit:
        recommended, reason = "ddp", "a replica fits the budget; DDP is the faster for LoRA"
    else:
        recommended = "fsdp"
        reason = (f"a replica does not fit the budget less {margin:.0%} headroom"
                  + ("" if fsdp <= limit else "; FSDP2 is predicted over it too: more processes or a smaller run"))
    return RankPeaks(nproc, budget_bytes, int(ddp), int(fsdp), schedule.mode, recommended, reason)
