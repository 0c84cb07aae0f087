# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU wheel keeps the venv small on machines without CUDA; with a GPU, pip picks the CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test lint format clean venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		echo "no CUDA here: installing the CPU build of torch"; $(PIP) install -q "$(TORCH_CPU)"; fi
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/crossdistill demo --out runs/demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check crossdistill tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider --durations=25

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check crossdistill tests benchmarks
	$(VENV)/bin/ruff format --check crossdistill tests benchmarks

format: $(VENV)/.installed
	$(VENV)/bin/ruff format crossdistill tests benchmarks
	$(VENV)/bin/ruff check --fix crossdistill tests benchmarks

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
