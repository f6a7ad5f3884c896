"""The digits VLM demo: a ``LlavaForConditionalGeneration`` trained here on questions about handwritten digits, and
every method of :mod:`vitrim.vlm` measured on it (``vitrim demo vlm``, ``vitrim vlm ask``, ``vitrim viz vlm``).

Modules: :mod:`~vitrim.demos.vlm.data` (canvases and questions), :mod:`~vitrim.demos.vlm.words` (vocabulary and
processor), :mod:`~vitrim.demos.vlm.model` (the config, building and saving), :mod:`~vitrim.demos.vlm.run_folder`
(loading a run folder, checked as files from anyone), :mod:`~vitrim.demos.vlm.train`, :mod:`~vitrim.demos.vlm.evaluate`,
:mod:`~vitrim.demos.vlm.sweep` (the methods), :mod:`~vitrim.demos.vlm.attention`, :mod:`~vitrim.demos.vlm.pictures`,
:mod:`~vitrim.demos.vlm.report`, :mod:`~vitrim.demos.vlm.ask`, :mod:`~vitrim.demos.vlm.demo`.
"""
