"""The plugin as vLLM finds it: the ``vllm.general_plugins`` entry point, and a register that can run again."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from vitrim.vllm.options import ARCHITECTURES
from vitrim.vllm.plugin import register
from vllm import ModelRegistry


def test_vllm_finds_the_plugin_through_its_entry_point() -> None:
    plugins = {plugin.name: plugin.value for plugin in entry_points(group="vllm.general_plugins")}
    assert plugins.get("vitrim") == "vitrim.vllm.plugin:register"


def test_register_adds_both_architectures_and_a_second_call_changes_nothing() -> None:
    register()
    first = {name: ModelRegistry.models[name] for name in ARCHITECTURES}
    register()
    assert set(ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())
    assert all(ModelRegistry.models[name] is first[name] for name in ARCHITECTURES)  # not registered anew


def test_the_registered_classes_subclass_vllms_own() -> None:
    for name, served in ARCHITECTURES.items():
        cls = getattr(importlib.import_module(served.module), name)
        parent = served.vllm_class  # a direct base (the Qwen classes mix QwenImageTrimming in before it)
        # vLLM's interface declarations aside (Gemma 3 declares M-RoPE and multimodal pruning, which vLLM's lacks)
        interfaces = "vllm.model_executor.models.interfaces"
        bases = [base for base in cls.__bases__ if base.__module__.startswith("vllm.model_executor")]
        bases = [base for base in bases if base.__module__ != interfaces]
        assert [base.__name__ for base in bases] == [parent], (name, cls.__bases__)
