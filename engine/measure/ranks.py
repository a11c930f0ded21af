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
(:data:`~.planner.MARGIN`): for LoRA it is the faster of the two (docs/MULTI_GPU.md). When no
schedule fits one process, even streaming, :func:`sharded_choice` chooses among what FSDP2 can
run by its per-rank peak (:func:`sharded_probe`) and recommends FSDP2. With streaming on a GPU
that is rare for a LoRA: a streamed replica holds about what an FSDP2 rank gathers, so FSDP2 wins
only where sharding the LoRA's optimizer state (and, not modelled, the root's weights) is the
difference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from .planner import MARGIN, PlanChoice, PlannerError, Prediction, choose, predict
from .probe import Probe
from .sweep import sweep_schedules


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


def sharded_probe(probe_: Probe, nproc: int) -> Probe:
    """What one FSDP2 rank of ``nproc`` would have measured (see the module docstring): the step's
    peak, its memory at the end of forward and its held bytes less the blocks' frozen weights, LoRA
    and optimizer state x (1 - 1/``nproc``), plus two gathered blocks (frozen + LoRA); no block
    weights to stream (``fsdp`` refuses streaming). :func:`~.planner.predict` on it gives a
    schedule's FSDP2 per-rank peak."""
    blocks = [(probe_.frozen_block_bytes.get(name, [0] * len(costs))[i], c.grad,
               probe_.optimizer_block_bytes.get(name, [0] * len(costs))[i])
              for name, costs in probe_.blocks.items() for i, c in enumerate(costs)]
    sharded = sum(frozen + grad + state for frozen, grad, state in blocks)
    gathered = 2 * max((frozen + grad for frozen, grad, _ in blocks), default=0)
    delta = gathered - sharded * (nproc - 1) // nproc
    return dataclasses.replace(
        probe_, peak_bytes=probe_.peak_bytes + delta, held_bytes=probe_.held_bytes + delta, frozen_block_bytes={},
        blocks_end_bytes=None if probe_.blocks_end_bytes is None else probe_.blocks_end_bytes + delta)


def _lora_bytes(probe_: Probe) -> int:
    return sum(c.grad for costs in probe_.blocks.values() for c in costs)


def _recommend(nproc: int, budget_bytes: int, ddp: int, fsdp: int, fsdp_mode: str, margin: float) -> RankPeaks:
    limit = budget_bytes * (1 - margin)
    if ddp <= limit:
        recommended, reason = "ddp", "a replica fits the budget; DDP is the faster for LoRA"
    else:
        recommended = "fsdp"
        reason = (f"a replica does not fit the budget less {margin:.0%} headroom"
                  + ("" if fsdp <= limit else "; FSDP2 is predicted over it too: more processes or a smaller run"))
    return RankPeaks(nproc, budget_bytes, int(ddp), int(fsdp), fsdp_mode, recommended, reason)


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
    schedule = chosen.schedule
    if schedule.streams or schedule.gradient_checkpointing_offload_attention:
        schedule = schedule.replace(weight_offload="none", weight_offload_blocks=None,
                                    gradient_checkpointing_offload_attention=False)
    fsdp = predict(sharded_probe(probe_, nproc), schedule).peak_bytes
    return _recommend(nproc, budget_bytes, chosen.peak_bytes + _lora_bytes(probe_), fsdp, schedule.mode, margin)


def sharded_choice(error: PlannerError, budget_bytes: int, nproc: int, margin: float = MARGIN) -> PlanChoice:
    """No schedule fits one process (``error``, raised by :func:`~.planner.choose`): the fastest
    schedule FSDP2 can run (no attention offload, no streaming) whose per-rank peak on ``nproc``
    processes fits, predicted on :func:`sharded_probe` (not measured: plan runs one process), with
    FSDP2 recommended.

    Raises:
        PlannerError: FSDP2 does not fit either; the message gives both smallest peaks.
    """
    candidates = [s for s in sweep_schedules() if not s.gradient_checkpointing_offload_attention]
    try:
        choice = choose(sharded_probe(error.probe, nproc), budget_bytes, candidates, margin, stream=True)
    except PlannerError as exc:
        raise PlannerError(f"{error}; FSDP2 on {nproc} processes: {exc}") from None
    choice.probe = error.probe
    choice.notes.append(f"no schedule fits one process ({error}): the peaks above are FSDP2's per rank on {nproc} "
                        "processes, predicted (plan measures one process)")
    choice.ranks = _recommend(nproc, budget_bytes, error.smallest.peak_bytes + _lora_bytes(error.probe),
                              choice.chosen.peak_bytes, choice.chosen.schedule.mode, margin)
    return choice
