"""The ``vllm.general_plugins`` entry point: register vitrim's architectures with vLLM's ``ModelRegistry``.

vLLM calls :func:`register` in every process it starts (front end, engine core, each worker), so it must be cheap
and idempotent: it registers the classes by ``"module:Class"`` name, which vLLM imports only when a model with one
of these architectures is loaded. On a CPU platform it also gives the CPU runner the line vitrim.vllm.compat names,
which changes nothing for a model that does not ask for pruning, and it registers the config hook of vitrim's Gemma 3
architecture (vitrim.vllm.compat.declare_gemma3_mrope; no other architecture's). It checks nothing else: the vLLM
version and the options are checked when such a model starts (vitrim.vllm.compat, vitrim.vllm.options), so a vLLM
that serves other models is never disturbed.
"""

from __future__ import annotations

from vitrim.vllm.options import ARCHITECTURES


def register() -> None:
    """Register every architecture of :data:`vitrim.vllm.options.ARCHITECTURES`, the families' ``served``
    (again: a no-op)."""
    from vllm.platforms import current_platform

    from vitrim.vllm.compat import declare_gemma3_mrope
    from vllm import ModelRegistry

    declare_gemma3_mrope()
    if current_platform.is_cpu():
        from vitrim.vllm.compat import patch_cpu_runner

        patch_cpu_runner()
    known = set(ModelRegistry.get_supported_archs())
    for name, served in ARCHITECTURES.items():
        if name not in known:
            ModelRegistry.register_model(name, f"{served.module}:{name}")
