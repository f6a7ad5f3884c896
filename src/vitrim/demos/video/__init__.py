"""The digits video demo: a ``Qwen2VLForConditionalGeneration`` trained here on questions about clips of a moving
digit whose answers need the time axis, and every video method of :mod:`vitrim.vlm` measured on it
(``vitrim demo video``).

Modules: :mod:`~vitrim.demos.video.data` (clips and questions), :mod:`~vitrim.demos.video.words` (vocabulary and
processor), :mod:`~vitrim.demos.video.model` (the config), :mod:`~vitrim.demos.video.run_folder` (loading a run
folder, checked as files from anyone), :mod:`~vitrim.demos.video.train`, :mod:`~vitrim.demos.video.evaluate`,
:mod:`~vitrim.demos.video.sweep` (the methods), :mod:`~vitrim.demos.video.report`, :mod:`~vitrim.demos.video.demo`.
"""
