# podkit: `make setup` once, then `bin/preflight` / `bin/smoke`; `make test` runs the suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get this pinned CPU build; a pod's image already has its CUDA torch.
TORCH_CPU ?= torch==2.13.0

.PHONY: setup test preflight smoke bench deploy fetch-logs envsetup clean pod-up pod-down

# Values reach the commands as "$$VAR" (make exports command-line variables to recipes), never pasted into
# the shell text: a quote in GPU='RTX "4090' is then part of the value, not a syntax error.
# Pod options, all optional: make deploy HOST=... KEY=~/.ssh/id_ed25519 PROFILE=runpod REMOTE_DIR=/workspace/x
# FORCE=1 (deploy into a non-empty REMOTE_DIR podkit did not create; its files are kept, never overwritten), ACCEPT_NEW=1 (record an unknown host key), PODS=pods.toml (inventory), CONFIG=job.toml (preflight on the pod).
POD_ARGS = $(if $(KEY),--key "$$KEY") $(if $(PROFILE),--profile "$$PROFILE") \
  $(if $(REMOTE_DIR),--remote-dir "$$REMOTE_DIR") $(if $(PYTHON),--python "$$PYTHON") \
  $(if $(ACCEPT_NEW),--accept-new) $(if $(PODS),--inventory "$$PODS") $(if $(BWLIMIT),--bwlimit "$$BWLIMIT") \
  $(if $(SSH_CONFIG),--ssh-config "$$SSH_CONFIG")

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
	$(PY) -m pip install -q -e '.[test,plot,sinks]'
	@touch $@
	@echo "setup: done. Next: bin/preflight, then bin/smoke"

# Two workers on a 2-core machine (at most 4): the suite waits on sshd, torchrun and subprocesses as much as it
# computes. --dist loadfile keeps each file's tests in order on one worker (test_pods.py's scenario shares a pod).
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile

preflight: setup
	bin/preflight $(ARGS)

smoke: setup
	bin/smoke $(ARGS)

bench: setup
	$(PY) benchmarks/accuracy.py
	$(PY) benchmarks/traced_vs_analytic.py
	$(PY) benchmarks/memory_estimators.py
	$(PY) benchmarks/smoke_overhead.py
	$(PY) benchmarks/deploy_sync.py

deploy: setup
	@test -n "$$HOST" || { echo "usage: make deploy HOST=user@host[:port] [KEY=path] (or HOST='ssh root@IP -p PORT -i KEY')" >&2; exit 2; }
	bin/deploy $(POD_ARGS) $(if $(CONFIG),--config "$$CONFIG") $(if $(FORCE),--force) "$$HOST"

fetch-logs: setup
	@test -n "$$HOST" || { echo "usage: make fetch-logs HOST=user@host[:port] [KEY=path]" >&2; exit 2; }
	bin/fetch-logs $(POD_ARGS) "$$HOST"

# Provision through RunPod's API (key from RUNPOD_API_KEY or .podkit/env): make pod-up GPU="A100 PCIe" [COUNT=2]
# [NAME=a100] [IMAGE=...] [VOLUME_GB=100] [DISK_GB=40] [KEY=~/.ssh/id_ed25519] [PODS=pods.toml]; then make deploy HOST=<name>.
# Cost guard (the pod stops itself; needs ACCEPT_NEW=1): STOP_AFTER_SMOKE=1, STOP_AFTER=hours, IDLE_STOP=minutes.
pod-up: setup
	@test -n "$$GPU" || { echo "usage: make pod-up GPU=<type> [COUNT=N] [NAME=...] (bin/pod gpus lists the types)" >&2; exit 2; }
	bin/pod up --gpu "$$GPU" $(if $(COUNT),--count "$$COUNT") $(if $(NAME),--name "$$NAME") \
	  $(if $(IMAGE),--image "$$IMAGE") $(if $(VOLUME_GB),--volume-gb "$$VOLUME_GB") $(if $(DISK_GB),--disk-gb "$$DISK_GB") \
	  $(if $(KEY),--key "$$KEY") $(if $(PODS),--inventory "$$PODS") $(if $(ACCEPT_NEW),--accept-new) \
	  $(if $(STOP_AFTER_SMOKE),--stop-after-smoke) $(if $(STOP_AFTER),--stop-after "$$STOP_AFTER") \
	  $(if $(IDLE_STOP),--idle-stop "$$IDLE_STOP") $(if $(REMOTE_DIR),--remote-dir "$$REMOTE_DIR")

# Stop (volume kept) or, with TERMINATE=1, delete a pod that pod-up brought up: make pod-down NAME=a100
pod-down: setup
	@test -n "$$NAME" || { echo "usage: make pod-down NAME=<name> [TERMINATE=1]" >&2; exit 2; }
	bin/pod down "$$NAME" $(if $(TERMINATE),--terminate) $(if $(PODS),--inventory "$$PODS")

# On the pod itself (deploy runs this there): venv reusing the image's torch, deps, env file.
envsetup:
	bin/envsetup $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
