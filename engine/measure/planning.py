"""The plan as a measurement (``segckpt plan``, the Schedule Planner node, through the facade's
``plan``): probe, choose with :mod:`.planner`'s model, time the contenders head to head, try the
levers, judge the choice per batch shape when the data has several, and on several processes
predict it per rank (:mod:`.ranks`).

Levers (``segckpt plan --levers``: keeping attention outputs, ``gradient_checkpointing_save_attention``,
and per-block compile, ``compile_blocks``) are measured rather than predicted, each kept only when
the chosen schedule measures faster with it within the budget (:func:`try_levers`).

The time model is only as good as its calibration (see :mod:`.planner`): when asked to measure,
:func:`plan_for_budget` times the chosen prediction and the fastest fitting ones had the calibrated
offloader cost been half or twice as large (:func:`~.planner.contenders`) head to head in lockstep,
and keeps the fastest measured one that fits (measured ties again follow the documents' rule).
"""

from __future__ import annotations

import dataclasses

from ..config import MeasureConfig
from ..config.measure import LEVERS
from .frames import frames_label, use_frames
from .lockstep import lockstep_runs, paired_ratio
from .planner import (
    MARGIN,
    SENSITIVITY,
    TIE,
    PlanChoice,
    PlannerError,
    Prediction,
    choose,
    contenders,
    predict,
    preference,
)
from .preflight import preflight
from .probe import Probe, first_probe_steps, probe, probe_steps
from .ranks import rank_peaks, sharded_choice
from .runs import MeasurementInterrupted, PlanInterrupted, RunWorkspace, peak_after_warmup
from .sweep import sweep_schedules

MAX_TRIES = 4
"""Choices measured over the budget before the planner gives up (each is excluded and the choice repeats)."""


def plan_for_budget(workspace: RunWorkspace, measure: MeasureConfig | None, budget_bytes: int, *,
                    host_budget_bytes: int | None = None, probe_: Probe | None = None) -> PlanChoice:
    """Probe, choose, and (``measure.plan.timing_steps`` > 0) measure before deciding.

    With timing steps the chosen prediction and other fitting ones (see
    :func:`~.planner.contenders`) train that many steps after ``measure.warmup_steps`` in lockstep
    (:mod:`.lockstep`: one step of each in turn, so a shared machine's drift cancels) and the
    fastest measured one whose measured peak fits is chosen. Candidates measured over the budget
    are marked as not fitting and the choice repeats without them, at most :data:`MAX_TRIES`
    times; then the levers of ``measure.plan.levers`` are tried (:func:`try_levers`).
    ``measure.frames``: pixel-frame counts (checked by :func:`~.frames.check_measure_frames`): one
    probe per count on synthetic clips (:func:`~.frames.use_frames`), a prediction per count
    (:attr:`~.planner.PlanChoice.by_frames`), and the choice made (and measured) at the largest
    count, noted when it is predicted not to fit a smaller one. Otherwise, when the data has
    several batch shapes (buckets, clips), the choice is judged per shape (:func:`judge_per_shape`).
    ``measure.plan.nproc`` >= 2: the choice's per-rank peak under DDP and FSDP2 and which to run,
    in ``choice.ranks`` (:mod:`.ranks`); when nothing fits one process, the fastest schedule whose
    FSDP2 per-rank peak fits (predicted).

    Args:
        workspace: not open (:class:`~.runs.RunWorkspace`, opened here): the run settings, the
            loaded model, the run maker (tests inject their own) and ``on_step`` / ``should_stop``
            (progress and Cancel after every step of every run).
        budget_bytes / host_budget_bytes: the device's and the host's budgets, bytes (the host's:
            what streamed weights and offloaded activations may use; None: not counted).
        probe_: a probe of the same model and settings to reuse (several budgets), else one runs.

    Raises:
        PlannerError: nothing is predicted to fit (on one process, nor under FSDP2 on ``nproc``),
            or no tried candidate fits when measured.
        MeasurementInterrupted: ``should_stop`` answered True (``PlanInterrupted`` of ``runs.py``,
            holding the prediction, when it happened in the head-to-head measurement; Ctrl-C
            there raises it too).
    """
    measure = measure or MeasureConfig()
    nproc = measure.plan.nproc
    with workspace:
        planning = _Planning(measure, budget_bytes, host_budget_bytes, workspace)
        try:
            choice = planning.over_frames() if measure.frames else planning.once(probe_)
        except PlannerError as exc:
            if nproc == 1 or exc.probe is None:
                raise
            return sharded_choice(exc, budget_bytes, nproc)
    data = workspace.config.data
    if not measure.frames and (data.buckets or data.video):
        judge_per_shape(choice, workspace.fresh(schedule=choice.chosen.schedule), measure)
    choice.ranks = rank_peaks(choice.probe, choice.chosen, budget_bytes, nproc)
    return choice


def judge_per_shape(choice: PlanChoice, workspace: RunWorkspace, measure: MeasureConfig) -> None:
    """The pre-flight of the chosen schedule per batch shape of the data (:func:`~.preflight.preflight`
    in ``workspace``, not open, whose schedule is the chosen one: the planner's probe mixed the
    shapes), kept as ``choice.verdict``; when a shape does not fit,
    the schedule the pre-flight names instead becomes the choice (said in ``choice.notes``;
    not timed, so no measured figures and no ``compile_blocks`` decision go with it)."""
    verdict = preflight(workspace, choice.budget_bytes, measure, host_budget_bytes=choice.host_budget_bytes)
    choice.verdict = verdict
    if verdict.fits or verdict.suggestion is None:
        return
    choice.notes.append(f"per batch shape {choice.chosen.schedule.mode} does not fit: chosen instead "
                        f"{verdict.suggestion.mode} (predicted, not measured)")
    chosen = next((p for p in choice.candidates if p.schedule == verdict.suggestion), None)
    if chosen is None:
        chosen = dataclasses.replace(predict(choice.probe, verdict.suggestion), fits=True)
        choice.candidates.append(chosen)
    choice.chosen, choice.compile_blocks = chosen, None
    choice.measured_sec_per_step, choice.measured_peak_bytes = chosen.measured_sec_per_step, chosen.measured_peak_bytes


@dataclasses.dataclass
class _Planning:
    """One plan's settings and workspace (open: the data is encoded once for every run of it)."""

    measure: MeasureConfig
    budget_bytes: int
    host_budget_bytes: int | None
    workspace: RunWorkspace
    announced: int = 0
    """Steps announced for timing not started yet: the probe, then as many contenders as can be
    timed (corrected when known)."""

    def __post_init__(self) -> None:
        steps = self.measure.plan.timing_steps
        self.announced = (1 + len(SENSITIVITY)) * (self.measure.warmup_steps + steps) if steps > 0 else 0

    def once(self, probe_: Probe | None) -> PlanChoice:
        """Probe (unless ``probe_`` is given) and decide."""
        warmup = self.measure.warmup_steps
        self.workspace.expect((first_probe_steps(self.workspace, warmup) if probe_ is None else 0) + self.announced)
        return self.decide(probe_ or probe(self.workspace, warmup))

    def over_frames(self) -> PlanChoice:
        """Over pixel-frame counts: probe each (the first calibrates the offloader for the
        others), predict each, decide at the largest."""
        frames, warmup = self.measure.frames, self.measure.warmup_steps
        first = first_probe_steps(self.workspace, warmup)
        self.workspace.expect(first + (len(frames) - 1) * probe_steps(warmup, False) + self.announced)
        probes: dict[int, Probe] = {}
        calibration = None
        for n in frames:
            with use_frames(self.workspace, n):
                probes[n] = probe(self.workspace, warmup, calibration=calibration)
            calibration = probes[n].calibration
        largest = max(frames)
        with use_frames(self.workspace, largest):
            choice = self.decide(probes[largest])
        for n in frames:
            self._at_count(choice, n, probes[n], largest)
        choice.by_frames = {n: choice.by_frames[n] for n in frames if n in choice.by_frames}
        resolution = self.workspace.config.data.resolution
        choice.labels = {n: frames_label(resolution, self.workspace.bundle, n) for n in frames}
        return choice

    def _at_count(self, choice: PlanChoice, n: int, probed: Probe, largest: int) -> None:
        """The prediction at ``n`` frames in ``choice.by_frames``; noted when the choice does not fit there."""
        if n == largest:
            choice.by_frames[n] = choice
            return
        try:
            choice.by_frames[n] = choose(probed, self.budget_bytes, host_budget_bytes=self.host_budget_bytes,
                                         stream=self.workspace.config.schedule.streams)
        except PlannerError as exc:  # cannot happen when the largest count fits; said, not raised
            choice.notes.append(f"{n} frames: {exc}")
            return
        if predict(probed, choice.chosen.schedule).peak_bytes > self.budget_bytes * (1 - MARGIN):
            choice.notes.append(f"{choice.chosen.schedule.mode} is predicted over the budget at {n} frames")

    def decide(self, measured_probe: Probe) -> PlanChoice:
        """Choose; with timing steps, time the contenders and keep the fastest that fits when
        measured (excluding those measured over the budget), then try the levers."""
        excluded: list[str] = []
        notes: list[str] = []
        for _ in range(MAX_TRIES):
            candidates = [s for s in sweep_schedules() if s.mode not in excluded]
            choice = choose(measured_probe, self.budget_bytes, candidates, host_budget_bytes=self.host_budget_bytes,
                            stream=self.workspace.config.schedule.streams)
            choice.candidates = [p for p in choice.candidates if p.schedule.mode not in excluded]
            choice.notes = notes
            if self.measure.plan.timing_steps <= 0:
                return choice
            timed = contenders(choice)
            self._time(choice, timed)
            for p in timed:
                if p.measured_peak_bytes > self.budget_bytes:
                    p.fits = False
                    excluded.append(p.schedule.mode)
                    notes.append(f"{p.schedule.mode} measured {p.measured_peak_bytes / 2**30:.4g} GiB, over the "
                                 f"budget (predicted {p.peak_bytes / 2**30:.4g}): tried the next candidate")
            if choice.measured_peak_bytes <= self.budget_bytes:
                if self.measure.plan.levers:
                    try_levers(choice, self.workspace, self.measure.warmup_steps, self.measure.plan.timing_steps,
                               self.measure.plan.levers)
                return choice
        raise PlannerError(f"budget={self.budget_bytes / 2**30:.4g} GiB: none of the candidates tried fits when "
                           f"measured ({'; '.join(notes)})")

    def _time(self, choice: PlanChoice, timed: list[Prediction]) -> None:
        """Time ``timed`` head to head; keep what was decided before it when interrupted."""
        warmup, steps = self.measure.warmup_steps, self.measure.plan.timing_steps
        self.workspace.expect(len(timed) * (warmup + steps) - self.announced)  # the steps that run now
        self.announced = 0
        try:
            _time_head_to_head(self, choice, timed)
        except (MeasurementInterrupted, KeyboardInterrupt) as exc:  # keep what was decided before it
            for p in timed:
                p.measured_peak_bytes = p.measured_sec_per_step = None
            choice.measured_peak_bytes = choice.measured_sec_per_step = None
            choice.notes.append(f"the head-to-head measurement of {len(timed)} candidates was interrupted: the "
                                "choice is the prediction, not measured")
            raise PlanInterrupted("plan measurement interrupted", choice) from exc


def _time_head_to_head(planning: _Planning, choice: PlanChoice, timed: list[Prediction]) -> None:
    """Run ``timed`` in lockstep; record their measured numbers; choose the fastest measured one
    that fits (measured ties within ``TIE`` follow the documents' rule)."""
    warmup = planning.measure.warmup_steps
    results = lockstep_runs(planning.workspace, [p.schedule for p in timed], warmup, planning.measure.plan.timing_steps)
    for prediction, result in zip(timed, results):
        prediction.measured_sec_per_step = result.report["totals"]["sec_per_step"]
        prediction.measured_peak_bytes = peak_after_warmup(result, warmup)
        prediction.relative_time = paired_ratio(result, results[0], warmup) if len(timed) > 1 else None
    fitting = [p for p in timed if p.measured_peak_bytes <= choice.budget_bytes]
    if fitting and len(timed) > 1:
        fastest = min(p.relative_time for p in fitting)
        choice.chosen = min((p for p in fitting if p.relative_time <= fastest * (1 + TIE)),
                            key=lambda p: preference(p.schedule))
    choice.measured_sec_per_step = choice.chosen.measured_sec_per_step
    choice.measured_peak_bytes = choice.chosen.measured_peak_bytes


LEVER_GAIN = 0.02
"""A lever is kept only when it measures at least this much faster (2%: above the noise of a
paired measurement on a shared machine) with its measured peak within the budget."""


def try_levers(choice: PlanChoice, workspace: RunWorkspace, warmup_steps: int, measure_steps: int,
               names: tuple[str, ...] = LEVERS) -> None:
    """Measure the chosen schedule with each lever of ``names`` (:data:`LEVERS`) and keep a lever
    only when it is faster within the budget, time and peak measured (never predicted: its cost
    depends on the model and the card; FastVideo PR #1410, OneTrainer #1114 and the documents'
    compile regressions): ``gradient_checkpointing_save_attention`` (checkpointed ``torch`` or
    ``unsloth`` regions), then ``compile_blocks`` over what was kept. The choice's schedule, its
    measured figures and ``compile_blocks`` (True when kept, False when tried and not kept) follow,
    so :meth:`~.planner.PlanChoice.options` holds every decision; ``notes`` say which lever was
    kept and why.
    """
    base = choice.chosen.schedule
    levers = []
    if "save_attention" in names:
        if base.gradient_checkpointing and not base.backend.ffn_scope and not base.gradient_checkpointing_save_attention:
            levers.append(("gradient_checkpointing_save_attention",
                           base.replace(gradient_checkpointing_save_attention=True), {}))
        else:
            choice.notes.append(f"gradient_checkpointing_save_attention: not tried ({base.mode} has no whole-block "
                                "region to keep attention in)")
    if "compile" in names:
        levers.append(("compile_blocks", None, {"compile_blocks": True}))
    workspace.expect(len(levers) * (warmup_steps + measure_steps))
    for name, schedule, changes in levers:
        schedule = schedule or choice.chosen.schedule
        try:
            result = workspace.run(schedule, warmup_steps, measure_steps, **changes)
        except MeasurementInterrupted:
            raise
        except Exception as exc:  # noqa: BLE001 - a lever that fails is not kept
            choice.notes.append(f"{name}: not kept ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            _decided(choice, changes, False)
            continue
        seconds, peak = result.report["totals"]["sec_per_step"], peak_after_warmup(result, warmup_steps)
        ratio = seconds / choice.measured_sec_per_step
        figures = f"{ratio:.3f}x sec/step, peak {peak / 2**30:.4g} GiB"
        if peak > choice.budget_bytes:
            choice.notes.append(f"{name}: not kept ({figures}, over the budget)")
        elif ratio > 1 - LEVER_GAIN:
            choice.notes.append(f"{name}: not kept ({figures}: not faster by {LEVER_GAIN:.0%})")
        else:
            choice.notes.append(f"{name}: kept ({figures}, within the budget)")
            choice.measured_sec_per_step, choice.measured_peak_bytes = seconds, peak
            if not changes:
                choice.chosen = dataclasses.replace(choice.chosen, schedule=schedule)
            _decided(choice, changes, True)
            continue
        _decided(choice, changes, False)


def _decided(choice: PlanChoice, changes: dict, kept: bool) -> None:
    """Record the ``compile`` lever's decision (``changes`` holds ``compile_blocks``) in the choice."""
    if changes:
        choice.compile_blocks = kept
