"""Train LoRA inside ComfyUI asks ComfyUI's model management to unload its models and free its cached
device memory before a run (nodes/environment.py ``release_comfyui_models``; issue 36), with a fake
``comfy.model_management`` shaped as ComfyUI 0.3.64's (``current_loaded_models`` of ``LoadedModel``,
``unload_all_models``, ``soft_empty_cache``)."""

from __future__ import annotations

import sys
import types

from segmented_checkpointing.nodes.environment import local_host, release_comfyui_models


class Flux:  # what a ModelPatcher's .model is: the class name is what the log line names
    pass


class AutoencodingEngine:
    pass


class _Loaded:
    def __init__(self, model, size):
        self.model, self.size = types.SimpleNamespace(model=model), size

    def model_loaded_memory(self):
        return self.size


def _fake_management(monkeypatch, loaded):
    calls = []
    management = types.ModuleType("comfy.model_management")
    management.current_loaded_models = loaded
    management.unload_all_models = lambda: (calls.append("unload"), loaded.clear())
    management.soft_empty_cache = lambda: calls.append("empty cache")
    comfy = types.ModuleType("comfy")
    comfy.model_management = management
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", management)
    return calls


def test_comfyuis_models_are_unloaded_and_named(monkeypatch):
    calls = _fake_management(monkeypatch, [_Loaded(AutoencodingEngine(), 2**28), _Loaded(Flux(), 12 * 2**30)])
    assert release_comfyui_models() == ["ComfyUI unloaded 2 model(s) before training: Flux (12 GiB), "
                                        "AutoencodingEngine (0.25 GiB); its cached device memory was freed"]
    assert calls == ["unload", "empty cache"]
    assert release_comfyui_models() == ["ComfyUI held no models on the device; its cached device memory was "
                                        "freed before training"]
    assert calls == ["unload", "empty cache"] * 2


def test_a_local_run_releases_nothing(tmp_path):
    assert local_host(tmp_path).release_models() == []
