"""The digits VLM demo: a ``LlavaForConditionalGeneration`` trained here on questions about handwritten digits, and
every method of :mod:`vitrim.vlm` measured on it (``vitrim demo vlm``, ``vitrim vlm ask``, ``vitrim viz vlm``).

Modules: :mod:`~vitrim.vlm_demo.data` (canvases and questions), :mod:`~vitrim.vlm_demo.words` (vocabulary and
processor), :mod:`~vitrim.vlm_demo.model` (the config, building and saving), :mod:`~vitrim.vlm_demo.run_folder`
(loading a run folder, checked as files from anyone), :mod:`~vitrim.vlm_demo.train`, :mod:`~vitrim.vlm_demo.evaluate`,
:mod:`~vitrim.vlm_demo.sweep` (the methods), :mod:`~vitrim.vlm_demo.attention`, :mod:`~vitrim.vlm_demo.pictures`,
:mod:`~vitrim.vlm_demo.report`, :mod:`~vitrim.vlm_demo.ask`, :mod:`~vitrim.vlm_demo.demo`.
"""
