"""The three places a VLM sheds image tokens, one module each: before the LLM (:mod:`.pre_llm`), inside it
(:mod:`.in_llm`) and inside the vision tower (:mod:`.tower`); each has ``install(family, method, options)``
returning an :class:`~vitrim.vlm.method.base.Installation`. :mod:`.spans` and :mod:`.sequence` are the plumbing
they share (where a sequence's image tokens are; shortening it and decoding after)."""
