"""The segment runner on a toy diffusers model: keyword arguments, None arguments, tuple returns,
dropout (RNG preserved across recompute), and the carry map through a keyword argument."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from diffusers.models.modeling_utils import ModelMixin

from segmented_checkpointing.engine.config.schedule import CheckpointSchedule
from segmented_checkpointing.engine.core.plan import effective_plan
from segmented_checkpointing.engine.core.runner import SegmentRunner
from segmented_checkpointing.engine.families.base import BlockList, Carry, FamilyAdapter


class ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, hidden, unused, *, scale, context=None):
        assert unused is None
        return self.drop(self.lin(hidden)) * scale + hidden + context.mean(), context * 1.5


class ToyModel(ModelMixin):
    _supports_gradient_checkpointing = True

    def __init__(self, n: int = 7):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ToyBlock() for _ in range(n))
        self.gradient_checkpointing = False

    def forward(self, hidden, context):
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden, context = self._gradient_checkpointing_func(block, hidden, None, scale=0.5, context=context)
            else:
                hidden, context = block(hidden, None, scale=0.5, context=context)
            self.between_blocks(hidden)
        return hidden

    def between_blocks(self, hidden):
        """What the loop does to the carried state after each block (nothing here)."""


TOY = FamilyAdapter(
    name="toy", model_class="ToyModel",
    block_lists=(BlockList("blocks", "blocks", Carry(((0, 0), (1, "context")))),),
    text=None, make_inputs=None, read_output=None, tiny_config={}, latent_channels=8,
)


def _run(schedule, model_cls=None, blocks: int = 7):
    torch.manual_seed(0)
    model = (model_cls or ToyModel)(blocks)
    model.requires_grad_(False)
    for block in model.blocks:
        block.lin.weight.requires_grad_(True)
    if model_cls is not None:
        model.eval()  # no dropout: two runs draw differently once one falls back
    hidden = torch.randn(3, 8)
    context = torch.randn(3, 8, requires_grad=True)
    runner = SegmentRunner(model, TOY, effective_plan(TOY, schedule, {"blocks": blocks}, warn=False)).install()
    torch.manual_seed(42)
    runner.forward(hidden, context).square().sum().backward()
    grads = [b.lin.weight.grad for b in model.blocks] + [context.grad]
    return grads, runner


@pytest.mark.parametrize("schedule", [
    CheckpointSchedule(),
    CheckpointSchedule(gradient_checkpointing_interval=2),
    CheckpointSchedule(gradient_checkpointing_interval=3),
    CheckpointSchedule(gradient_checkpointing_interval=7),
    CheckpointSchedule(gradient_checkpointing_interval=2, gradient_checkpointing_segment_stride=3),
])
def test_kwargs_none_tuples_and_dropout(schedule):
    reference, _ = _run(CheckpointSchedule(gradient_checkpointing=False))
    grads, runner = _run(schedule)
    for a, b in zip(grads, reference):
        assert torch.equal(a, b)
    assert runner.stats.recomputed_blocks == runner.plan.checkpointed_blocks
    assert runner.stats.checkpoint_calls == len(runner.plan.lists[0].segments)
    assert not runner.stats.fallbacks


def test_recomputing_flag_is_set_only_during_recompute():
    seen = []
    torch.manual_seed(0)
    model = ToyModel(4)
    runner = SegmentRunner(model, TOY, effective_plan(TOY, CheckpointSchedule(gradient_checkpointing_interval=2),
                                                      {"blocks": 4}, warn=False)).install()
    model.blocks[1].register_forward_pre_hook(lambda *_: seen.append(runner.recomputing))
    runner.forward(torch.randn(2, 8), torch.randn(2, 8)).sum().backward()
    assert seen == [False, True]
    assert not runner.recomputing


class InPlaceResidualModel(ToyModel):
    """A loop that adds a residual into the carried hidden state in place between two blocks (as
    a ControlNet-style residual written with ``+=`` would)."""

    def __init__(self, n: int = 6):
        super().__init__(n)
        self.register_buffer("residual", torch.linspace(-1, 1, 8))

    def between_blocks(self, hidden):
        hidden.add_(self.residual)


def test_a_loop_that_changes_the_carried_state_in_place_falls_back_with_equal_gradients():
    reference, _ = _run(CheckpointSchedule(gradient_checkpointing=False), InPlaceResidualModel, 6)
    with pytest.warns(UserWarning, match="changed block 0's output in place before it called block 1"):
        got, runner = _run(CheckpointSchedule(gradient_checkpointing_interval=3), InPlaceResidualModel, 6)
    assert runner.plan.list_plan("blocks").segments == tuple((i, i + 1) for i in range(6))
    for a, b in zip(got, reference):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_closed_runner_leaves_no_reference_cycle_with_its_model():
    """Installed, the runner and the blocks hold each other; close() breaks that, so a finished
    run's model (its device weights and pinned host copies) is freed when its last reference goes,
    not whenever Python's cyclic collector happens to run (on an H200, the GPU check's second run measured
    the first run's 24 GiB model in its peak)."""
    gc.collect()
    gc.disable()
    try:
        for close in (False, True):
            _, runner = _run(CheckpointSchedule(gradient_checkpointing_interval=2))
            model = weakref.ref(runner.model)
            assert model()._gradient_checkpointing_func is runner
            if close:
                runner.close()
                assert model()._gradient_checkpointing_func is not runner
            del runner
            assert (model() is None) == close  # without close(), only the cyclic collector would free it
    finally:
        gc.enable()
        gc.collect()
