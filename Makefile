# One virtual environment for everything; torch is pinned here (the CPU build this machine carries), with the
# torchvision built for it (timm needs it; tests/conftest.py stubs its compiled ops where they do not load),
# while the library itself only asks for torch>=2.4.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0 torchvision==0.28.0
# lxt (AttnLRP's reference implementation, used by tests/viz) asks for bitsandbytes, open_clip_torch, accelerate and
# zennit, none of which its rules and its ViT patch import (they need torch, and torchvision, installed above): it is
# installed alone, with --no-deps.
LXT_VERSION ?= 2.1
STAMP := $(VENV)/.installed

.PHONY: test test-all demo demo-translate lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH_PIN)
	$(PY) -m pip install --quiet --no-deps lxt==$(LXT_VERSION)
	touch $(STAMP)

# The suite in parallel, one worker per core (tests/conftest.py gives each one torch thread). `make test` runs one
# case per model family and per reducer of the heavy sweeps; `make test-all` runs their full cross product too.
test: $(STAMP)
	$(PY) -m pytest -n auto -m "not full"

test-all: $(STAMP)
	$(PY) -m pytest -n auto

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m mypy

demo: $(STAMP)
	$(VENV)/bin/vitrim demo
	$(VENV)/bin/vitrim demo translate

demo-translate: $(STAMP)
	$(VENV)/bin/vitrim demo translate

bench: $(STAMP)
	$(VENV)/bin/vitrim bench attention

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
