"""One SDPA kernel choice for forward, backward and every recompute; cuDNN off with ``auto``."""

from __future__ import annotations

import pytest
import torch

from segmented_checkpointing.engine.config import TrainConfig
from segmented_checkpointing.engine.model.attention_kernels import (
    AttentionBackendError,
    enabled_kernels,
    parse_attention_backend,
)
from segmented_checkpointing.engine.model.bundle import build_preset
from segmented_checkpointing.engine.train.loop import train

ALL = ("flash", "efficient", "math", "cudnn")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from segmented_checkpointing.engine.data.folder import write_sample_dataset

    return write_sample_dataset(tmp_path_factory.mktemp("kernels") / "data")


@pytest.mark.parametrize("choice, expected", [("auto", ("flash", "efficient", "math")), ("math", ("math",)),
                                              ("flash, math", ("flash", "math"))])
def test_the_choice_holds_in_the_forward_and_in_the_recompute(tmp_path, data_dir, choice, expected):
    assert enabled_kernels() == ALL  # torch's default: cuDNN on (and first on H100/H200)
    bundle = build_preset("flux")
    seen: list[tuple[bool, tuple[str, ...]]] = []
    checkpointed = bundle.transformer.transformer_blocks[0]  # segment 0-1 of interval 2 stride 4
    checkpointed.register_forward_pre_hook(lambda module, args: seen.append((torch.is_grad_enabled(), enabled_kernels())))
    config = TrainConfig.create(output=str(tmp_path / "run"), data=str(data_dir), resolution=64, steps=2,
                         attention_backend=choice)
    result = train(config, bundle=bundle, log=lambda line: None)
    assert len(seen) == 2 * 2  # per step: the forward, then its recompute inside backward
    assert all(kernels == expected for _, kernels in seen), seen
    assert result.report["attention_backend"] == list(expected)
    assert enabled_kernels() == ALL  # restored after the run


@pytest.mark.parametrize("value, message", [
    ("", "allowed auto or a comma-separated list"), ("flash,sage", "unknown 'sage'"),
    ("math,math", "a name is repeated"), (["flash", 3], "allowed auto"),
])
def test_invalid_values_name_what_is_allowed(value, message):
    with pytest.raises(AttentionBackendError, match=message):
        parse_attention_backend(value)


def test_a_json_list_is_kept_as_its_canonical_string():
    config, _ = TrainConfig.from_dict({"attention_backend": ["flash", "math"]})
    assert config.model.attention_backend == "flash,math"
