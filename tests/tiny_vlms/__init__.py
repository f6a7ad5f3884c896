"""The tests' tiny models, one module per family, built from a config alone (float64 unless said), with the prompt
and pixel builders that go with them; importable as ``tiny_vlms`` from every test folder (pytest puts ``tests/`` on
``sys.path`` for the suite's root ``conftest.py``).

- :mod:`.llava`, :mod:`.llava_next`, :mod:`.llava_onevision` (images and videos), :mod:`.gemma3`, :mod:`.paligemma`,
  :mod:`.qwen` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the Qwen3-VL-8B layout): models in memory, for tests/vlm and
  tests/fuzz;
- :mod:`.llms`: text-only LLMs the in-LLM drop is tested on directly;
- :mod:`.folders`: checkpoint folders on disk with a processor (``vitrim.vlm_user.tiny``'s builders, shipped with
  the CLI): for ``vitrim vlm ask`` (tests/vlm_user) and for vLLM (tests/vllm, benchmarks/vllm_bench.py).
"""
