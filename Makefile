# podkit: `make setup` once, then `bin/preflight` / `bin/smoke`; `make test` runs the suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get this pinned CPU build; a pod's image already has its CUDA torch.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test preflight smoke bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	@if python3 -c 'import torch' 2>/dev/null && python3 -c 'import torch,sys; sys.exit(0 if torch.version.cuda else 1)'; then \
	  echo "setup: reusing the image's CUDA torch (never reinstalled)"; \
	  python3 -m venv --system-site-packages $(VENV); \
	else \
	  python3 -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip; \
	  echo "setup: installing $(TORCH_CPU) (CPU build)"; \
	  $(PY) -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	@touch $@
	@echo "setup: done. Next: bin/preflight, then bin/smoke"

test: setup
	$(PY) -m pytest -q

preflight: setup
	bin/preflight $(ARGS)

smoke: setup
	bin/smoke $(ARGS)

bench: setup
	$(PY) benchmarks/memory_estimators.py
	$(PY) benchmarks/smoke_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
