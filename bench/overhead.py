"""Step-time overhead of the segment runner against diffusers' own code paths (CPU or CUDA).

Two pairs per family, each timed as one LoRA step (forward + loss + backward) of the same model:

* ``layer``: our :class:`SegmentRunner` with ``CheckpointSchedule()`` (per-block checkpointing)
  vs diffusers' ``enable_gradient_checkpointing()`` (its default checkpoint function);
* ``none``: our runner with ``gradient_checkpointing=False`` (``runner.forward``) vs the model
  called directly with checkpointing disabled.

The two sides of a pair run interleaved in one process after warm-up, the order flipped every
round (A, B, B, A, A, B, ...; ``--order abab`` for A, B, A, B), so drift of a shared, busy machine
hits both alike. Switching a side (installing the runner or diffusers' function) happens outside
the timed region. Printed as a markdown table: the wall-clock medians, their ratio, the median of
the per-round ratios (robust to slow drift), the ratio of the minima (noise from other jobs only
adds time), and the ratio of the medians of this process's CPU time per step.

Run: ``python bench/overhead.py [--rounds 25] [--warmup 3] [--threads 1] [--order abba] [--families flux sd3]
[--checks-only]``.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from segmented_checkpointing.engine.config import LoraSettings
from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.memory import StepTimer
from segmented_checkpointing.engine.core.plan import count_blocks, effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families import TextBatch, get_family
from segmented_checkpointing.engine.model.lora_files import add_lora

# Family -> (config overrides on top of the tiny preset, latent side in pixels of the latent grid).
# Sized so that a step takes roughly 50-200 ms on 2 CPU cores.
CONFIGS = {
    "flux": (dict(num_layers=3, num_single_layers=6, attention_head_dim=32, num_attention_heads=4,
                  joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=(8, 12, 12)), 16),
    "sd3": (dict(num_layers=8, attention_head_dim=32, num_attention_heads=4, caption_projection_dim=128,
                 joint_attention_dim=64, pooled_projection_dim=64, sample_size=32, pos_embed_max_size=32), 16),
}


def build(name: str, device: torch.device, side: int | None = None, overrides: dict | None = None):
    """Model with a rank-8 LoRA, and the keyword inputs and latents of one batch of 1 (``side``:
    another latent side than the config's; ``overrides``: other config changes than :data:`CONFIGS`'
    on top of the tiny preset)."""
    family = get_family(name)
    default_overrides, default_side = CONFIGS[name]
    overrides = default_overrides if overrides is None else overrides
    side = side or default_side
    torch.manual_seed(0)
    model = family.model_cls()(**{**family.tiny_config, **overrides}).to(device)
    add_lora(model, LoraSettings(rank=8, alpha=8), family.lora_targets)
    spec = family.text(model.config)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, family.latent_channels, side, side, generator=g).to(device)
    pooled = torch.randn(1, spec.pooled_dim, generator=g).to(device) if spec.pooled_dim else None
    text = TextBatch(torch.randn(1, spec.max_length, spec.seq_dim, generator=g).to(device),
                     torch.ones(1, spec.max_length, dtype=torch.bool, device=device), pooled)
    sigmas = torch.rand(1, generator=g).to(device)
    return family, model, latents, family.make_inputs(model, latents, sigmas, text)


def sides(family, model) -> dict[str, tuple[Callable[[], None], Callable]]:
    """Each side as (set-up outside the timer, the callable that runs the model)."""
    def runner(schedule: CheckpointSchedule) -> SegmentRunner:
        plan = effective_plan(family, schedule, count_blocks(family, model), warn=False)
        return SegmentRunner(model, family, plan)

    ours_layer = runner(CheckpointSchedule())
    ours_none = runner(CheckpointSchedule(gradient_checkpointing=False))
    ours_saving = runner(CheckpointSchedule(gradient_checkpointing_save_attention=True))
    return {
        "ours-layer": (ours_layer.install, ours_layer.forward),
        "ours-layer-save-attn": (ours_saving.install, ours_saving.forward),
        "diffusers-layer": (model.enable_gradient_checkpointing, model),
        "ours-none": (ours_none.install, ours_none.forward),
        "diffusers-none": (model.disable_gradient_checkpointing, model),
    }


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators a step dispatches (forward, backward and recompute)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step(family, model, latents, inputs, call) -> None:
    """One LoRA step: forward, flow-matching-style MSE against the latents, backward."""
    pred = family.read_output(model, call(**inputs), latents)
    (pred.float() - latents).pow(2).mean().backward()


def op_counts(family, model, latents, inputs) -> dict[str, int]:
    """Aten operators per step of each side: equal counts mean the runner adds no tensor work."""
    counts = {}
    for name, (setup, call) in sides(family, model).items():
        if name.endswith("-save-attn"):  # it runs fewer operators by design (no attention in backward)
            continue
        setup()
        model.zero_grad(set_to_none=True)
        with _OpCounter() as counter:
            _step(family, model, latents, inputs, call)
        counts[name] = counter.ops
    return counts


def runner_bookkeeping_s(family, model, latents, inputs, steps: int = 15) -> tuple[float, int]:
    """Seconds per ``layer`` step spent in the runner's own code in forward (the best of ``steps``
    steps after two warm-up steps: other jobs only add time), and its block calls per step.

    The runner's ``__call__`` is timed whole, minus the checkpoint call it makes (which runs the
    blocks); what is left is its dictionary look-ups, segment bookkeeping and the carry check.
    """
    inside, outside, calls = [0.0], [0.0], [0]

    def timed_checkpoint(fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    plan = effective_plan(family, CheckpointSchedule(), count_blocks(family, model), warn=False)
    runner = SegmentRunner(model, family, plan, checkpoint_fn=timed_checkpoint)

    def timed_runner(block, *args, **kwargs):
        start = time.perf_counter()
        try:
            return runner(block, *args, **kwargs)
        finally:
            outside[0] += time.perf_counter() - start
            calls[0] += 1

    model.enable_gradient_checkpointing(gradient_checkpointing_func=timed_runner)
    best = float("inf")
    for i in range(2 + steps):
        inside[0] = outside[0] = calls[0] = 0
        model.zero_grad(set_to_none=True)
        _step(family, model, latents, inputs, runner.forward)
        if i >= 2:
            best = min(best, outside[0] - inside[0])
    return best, calls[0]


def bench_pair(family, model, latents, inputs, a: str, b: str, rounds: int, warmup: int,
               device: torch.device, flip: bool = True) -> dict[str, dict[str, StepTimer]]:
    """Interleave sides ``a`` and ``b``; per side a wall-clock and a CPU-time timer.

    ``flip``: swap the order every round (a, b, b, a, a, b, ...), cancelling the first-in-round
    slowdown (about 1% here, whichever side goes first); otherwise a, b, a, b, ...
    """
    table = sides(family, model)
    timers = {name: {"wall": StepTimer(device, warmup), "cpu": StepTimer(device, warmup, time.process_time)}
              for name in (a, b)}
    for i in range(warmup + rounds):
        for name in ((b, a) if flip and i % 2 else (a, b)):
            setup, call = table[name]
            setup()
            model.zero_grad(set_to_none=True)  # outside the timer, like the set-up
            with timers[name]["wall"].step(), timers[name]["cpu"].step():
                _step(family, model, latents, inputs, call)
    return timers


LONG_SIDE = 96
"""Latent side of the save_attention comparison: 2304 image tokens + 16 text tokens for the Flux config
above, where attention is most of a block (it grows with the square of the sequence; at 1040 tokens
the selective checkpoint's per-operator dispatch still costs about what it saves on this CPU)."""


def save_attention_ratio(device: torch.device, rounds: int, warmup: int) -> tuple[float, float, int]:
    """Per-block recompute with the attention outputs kept vs plain, Flux at :data:`LONG_SIDE`:
    ``(median of paired ratios, ratio of minima, tokens)``; below 1 = keeping them is faster."""
    family, model, latents, inputs = build("flux", device, LONG_SIDE)
    t = bench_pair(family, model, latents, inputs, "ours-layer-save-attn", "ours-layer", rounds, warmup, device)
    a, b = t["ours-layer-save-attn"]["wall"].samples, t["ours-layer"]["wall"].samples
    tokens = (LONG_SIDE // 2) ** 2 + family.text(model.config).max_length
    return statistics.median(x / y for x, y in zip(a, b)), min(a) / min(b), tokens


def compile_ratio(device: torch.device, rounds: int, warmup: int) -> tuple[float, float, float]:
    """Per-block recompute with every block compiled (``compile_blocks``, inductor) vs eager, Flux at
    its config's size: ``(median of paired ratios, ratio of minima, compile seconds)``; below 1 =
    compiled is faster. The compile happens in the warm-up rounds, outside the timed ones."""
    from segmented_checkpointing.engine.core.compiling import compile_blocks, compile_seconds

    family, model, latents, inputs = build("flux", device)
    eager_model = copy.deepcopy(model)
    runners = {}
    for name, m in (("eager", eager_model), ("compiled", model)):
        plan = effective_plan(family, CheckpointSchedule(), count_blocks(family, m), warn=False)
        runners[name] = (m, SegmentRunner(m, family, plan).install())
    started = compile_seconds()
    compile_blocks(model, family, runners["compiled"][1])
    timers = {name: StepTimer(device, warmup) for name in runners}
    for i in range(warmup + rounds):
        for name in (("compiled", "eager") if i % 2 else ("eager", "compiled")):
            m, runner = runners[name]
            m.zero_grad(set_to_none=True)
            with timers[name].step():
                _step(family, m, latents, inputs, runner.forward)
    a, b = timers["compiled"].samples, timers["eager"].samples
    return statistics.median(x / y for x, y in zip(a, b)), min(a) / min(b), compile_seconds() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=25, help="measured A,B rounds per pair")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured A,B rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--order", choices=("abba", "abab"), default="abba",
                        help="abba: flip the order every round; abab: ours always first")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true",
                        help="also time compile_blocks against eager (inductor; about a minute of compiling on a CPU)")
    parser.add_argument("--checks-only", action="store_true",
                        help="only the load-independent checks (operator counts, runner bookkeeping)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
          f"threads {torch.get_num_threads()}, {args.rounds} rounds ({args.order}) after {args.warmup} warm-up\n")
    print("| family | pair | ours ms/step | diffusers ms/step | ratio of medians | median of paired ratios "
          "| ratio of minima | ratio of CPU-time medians |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    start = time.perf_counter()
    checks = []
    for name in args.families:
        family, model, latents, inputs = build(name, device)
        checks.append((name, op_counts(family, model, latents, inputs),
                       runner_bookkeeping_s(family, model, latents, inputs)))
        for pair in () if args.checks_only else ("layer", "none"):
            ours, theirs = f"ours-{pair}", f"diffusers-{pair}"
            t = bench_pair(family, model, latents, inputs, ours, theirs, args.rounds, args.warmup, device,
                           flip=args.order == "abba")
            wall_a, wall_b = t[ours]["wall"], t[theirs]["wall"]
            paired = statistics.median(x / y for x, y in zip(wall_a.samples, wall_b.samples))
            minima = min(wall_a.samples) / min(wall_b.samples)
            cpu = t[ours]["cpu"].median_s() / t[theirs]["cpu"].median_s()
            print(f"| {name} | {pair} | {wall_a.median_s() * 1e3:.1f} | {wall_b.median_s() * 1e3:.1f} "
                  f"| {wall_a.median_s() / wall_b.median_s():.3f} | {paired:.3f} | {minima:.3f} | {cpu:.3f} |")
            sys.stdout.flush()
    print("\nDeterministic checks (independent of machine load):\n")
    for name, ops, (bookkeeping, calls) in checks:
        print(f"- {name}: aten ops per step: ours-layer {ops['ours-layer']}, diffusers-layer "
              f"{ops['diffusers-layer']}, ours-none {ops['ours-none']}, diffusers-none {ops['diffusers-none']}; "
              f"runner bookkeeping in forward (best of 15 steps) {bookkeeping * 1e6:.0f} us per step over {calls} block calls "
              f"({bookkeeping / calls * 1e6:.1f} us per call)")
    if "flux" in args.families and not args.checks_only:
        paired, minima, tokens = save_attention_ratio(device, max(4, args.rounds // 3), args.warmup)
        print(f"- save_attention (flux, {tokens} tokens, per-block): step time with the attention outputs kept / "
              f"plain recompute: median of paired ratios {paired:.3f}, ratio of minima {minima:.3f}")
    if args.compile:
        paired, minima, seconds = compile_ratio(device, args.rounds, max(args.warmup, 2))
        print(f"- compile_blocks (flux, per-block): step time compiled / eager: median of paired ratios {paired:.3f}, "
              f"ratio of minima {minima:.3f}; {seconds:.0f} s compiling (in the warm-up)")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
