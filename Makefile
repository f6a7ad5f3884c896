# One virtual environment for everything; torch is pinned here (the CPU build this machine carries),
# while the library itself only asks for torch>=2.4.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo demo-translate lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH_PIN)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

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
