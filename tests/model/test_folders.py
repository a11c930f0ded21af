"""Loading: local diffusers folders round-trip, pickle weights are refused, classes are checked."""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_text_encoder

from segmented_checkpointing.engine.model.bundle import ModelLoadError, build_preset
from segmented_checkpointing.engine.model.folders import load_model_folder


def _save_pipeline(folder, family="flux", safe=True):
    bundle = build_preset(family)
    bundle.transformer.save_pretrained(folder / "transformer", safe_serialization=safe)
    bundle.vae.save_pretrained(folder / "vae", safe_serialization=safe)
    (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    return bundle


def test_pipeline_folder_round_trips_through_the_real_loader(tmp_path):
    original = _save_pipeline(tmp_path)
    loaded = load_model_folder(tmp_path, "flux")
    assert type(loaded.transformer).__name__ == "FluxTransformer2DModel"
    for (name, a), (_, b) in zip(original.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.source == str(tmp_path)
    text = loaded.encode_text(["a cat"])
    assert text.seq.shape == (1, 16, 32) and text.pooled.shape == (1, 32)


def test_family_is_inferred_from_the_folder(tmp_path):
    _save_pipeline(tmp_path)
    assert load_model_folder(tmp_path).family.name == "flux"


def test_pickle_weights_are_refused(tmp_path):
    _save_pipeline(tmp_path, safe=False)
    with pytest.raises(ModelLoadError, match=r"pickle weights \(diffusion_pytorch_model.bin\)"):
        load_model_folder(tmp_path, "flux")


def test_other_class_than_the_family_is_refused_naming_both(tmp_path):
    _save_pipeline(tmp_path, family="sd3")
    with pytest.raises(ModelLoadError) as info:
        load_model_folder(tmp_path, "flux")
    assert "SD3Transformer2DModel" in str(info.value) and "FluxTransformer2DModel" in str(info.value)


def test_bare_transformer_folder_needs_a_vae(tmp_path):
    bundle = build_preset("flux")
    bundle.transformer.save_pretrained(tmp_path / "t")
    with pytest.raises(ModelLoadError, match="no VAE"):
        load_model_folder(tmp_path / "t", "flux")
    bundle.vae.save_pretrained(tmp_path / "v")
    assert load_model_folder(tmp_path / "t", "flux", vae_path=tmp_path / "v").family.name == "flux"


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        load_model_folder(tmp_path / "nope", "flux")


def test_local_text_encoders_of_a_pipeline_folder(tmp_path):
    """Flux's pipeline layout: CLIP-L in text_encoder/ (pooled), T5 in text_encoder_2/ (states),
    each with its tokenizer folder."""
    _save_pipeline(tmp_path)
    save_tiny_text_encoder(tmp_path / "text_encoder", "clip", tokenizer_folder=tmp_path / "tokenizer")
    save_tiny_text_encoder(tmp_path / "text_encoder_2", "t5", tokenizer_folder=tmp_path / "tokenizer_2")
    bundle = load_model_folder(tmp_path, "flux")
    text = bundle.encode_text(["a cat", "a dog"])
    assert text.seq.shape == (2, 512, 32) and text.pooled.shape == (2, 32)  # T5 at Flux's 512 tokens
    assert text.mask[:, :2].all() and not text.mask[:, 2:].any()
    assert not torch.allclose(text.seq[0, 1], text.seq[1, 1])
    assert [e["kind"] for e in bundle.encode_text.describe()["encoders"]] == ["clip", "t5"]
