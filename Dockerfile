# Two GPU images. The default (last) stage: Triton Inference Server + TensorRT-LLM 1.1.0 from NGC,
# for paradraft's own runtime (TensorRT plans) and the LEGACY TensorRT-LLM engine path
# (`build --backend trtllm --trtllm-engine-legacy`, TensorRT-LLM <= 1.2.1).
# The `trtllm` stage (`docker build --target trtllm -t paradraft-trtllm .`): TensorRT-LLM >= 1.3
# (PyTorch backend only) for `build --backend trtllm`: trtllm-serve with the generated YAML, or
# Triton's llmapi model. BuildKit builds only the stage asked for.
FROM nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc24 AS trtllm
# The llmapi Triton model (model.py, helpers.py) of the same release, for the generated
# triton_repo (build/trtllm.py copies them from PARADRAFT_TRTLLM_SRC)
ARG TRTLLM_LLMAPI_REF=v1.3.0rc24
RUN (command -v git >/dev/null || (apt-get update && apt-get install -y --no-install-recommends git \
        && rm -rf /var/lib/apt/lists/*)) \
    && git clone --depth 1 --branch "${TRTLLM_LLMAPI_REF}" --filter=blob:none --sparse \
        https://github.com/NVIDIA/TensorRT-LLM.git /opt/tensorrt_llm_src \
    && git -C /opt/tensorrt_llm_src sparse-checkout set triton_backend/all_models/llmapi
WORKDIR /opt/paradraft
COPY pyproject.toml README.md ./
COPY paradraft paradraft
COPY build build
COPY runtime runtime
COPY triton_repo triton_repo
COPY models/demo models/demo
COPY scripts scripts
COPY tests tests
# as in the default stage: our dependencies constrained to the image's versions, nothing replaced
RUN python3 -m venv --system-site-packages /opt/venv \
    && /opt/venv/bin/pip list --format=freeze > image-constraints.txt \
    && /opt/venv/bin/python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(re.sub(r'[=<>!~;].*', '', d) for d in deps))" > deps.txt \
    && /opt/venv/bin/pip install --no-cache-dir -c image-constraints.txt -r deps.txt \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps -e . \
    && /opt/venv/bin/pip freeze > image-freeze.txt
ENV PATH=/opt/venv/bin:${PATH} \
    PARADRAFT_TRTLLM_SRC=/opt/tensorrt_llm_src
# trtllm-serve's OpenAI API on 8000 (Triton llmapi: 8000 HTTP, 8001 gRPC, 8002 metrics).
# Serve a deployment built into /engines (`paradraft build --backend trtllm --out /engines`)
CMD ["bash", "/engines/serve_trtllm.sh"]

# The default stage. GPU image: Triton Inference Server + TensorRT-LLM from NGC, with paradraft
# on top.
# 25.12 is the newest tag NVIDIA's Triton compatibility matrix lists with its versions:
# TensorRT 10.13.3.9, TensorRT-LLM 1.1.0, torch 2.9.0a0 (NVIDIA build), Python 3.12.3, CUDA 13.0
# (driver >= 580, or a data-center compatibility driver). Engines built in this image only run
# with this image's TensorRT / TensorRT-LLM: build them inside it (docs/gpu.md).
# The CPU image of the runtime is Dockerfile.cpu.
FROM nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 AS default

# LEGACY engine path: TensorRT-LLM's convert_checkpoint.py scripts and its Triton model templates
# (triton_backend/all_models/inflight_batcher_llm) are not in the image; take them from the
# release the image carries, so the stock model.py files match its backend.
ARG TRTLLM_REF=v1.1.0
RUN (command -v git >/dev/null || (apt-get update && apt-get install -y --no-install-recommends git \
        && rm -rf /var/lib/apt/lists/*)) \
    && git clone --depth 1 --branch "${TRTLLM_REF}" --filter=blob:none --sparse \
        https://github.com/NVIDIA/TensorRT-LLM.git /opt/tensorrt_llm_src \
    && git -C /opt/tensorrt_llm_src sparse-checkout set examples/models/core \
        triton_backend/all_models

WORKDIR /opt/paradraft
# Only what the package needs (there is no .dockerignore: a plain `COPY . .` would also copy a
# local .venv and engine dirs).
COPY pyproject.toml README.md ./
COPY paradraft paradraft
COPY build build
COPY runtime runtime
COPY triton_repo triton_repo
COPY models/demo models/demo
COPY scripts scripts
COPY tests tests

# pyproject pins torch==2.13.0 and numpy==1.26.4 for the CPU development machines (the CPU
# torch wheel; numpy < 2 for the tritonserver 2.51 stub bundled with nvidia-pytriton). Here the
# image's own stack must win: its torch is an NVIDIA CUDA build that tensorrt_llm is compiled
# against, and its Python backend stub matches its numpy. So: a venv that sees the image's
# packages (--system-site-packages), our dependencies by name only, constrained to every
# version the image already has (`pip list` of the image), then paradraft itself with
# --no-deps. Nothing the image ships is replaced; image-freeze.txt records what was resolved.
# Editable install: the demo models are found next to the sources (models/demo).
RUN python3 -m venv --system-site-packages /opt/venv \
    && /opt/venv/bin/pip list --format=freeze > image-constraints.txt \
    && /opt/venv/bin/python -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(re.sub(r'[=<>!~;].*', '', d) for d in deps))" > deps.txt \
    && /opt/venv/bin/pip install --no-cache-dir -c image-constraints.txt -r deps.txt \
    && /opt/venv/bin/pip install --no-cache-dir --no-deps -e . \
    && /opt/venv/bin/pip freeze > image-freeze.txt

ENV PATH=/opt/venv/bin:${PATH} \
    PARADRAFT_TRITONSERVER=/opt/tritonserver/bin/tritonserver \
    PARADRAFT_TRTLLM_SRC=/opt/tensorrt_llm_src

# Triton HTTP, gRPC, metrics, and the OpenAI-compatible API: `paradraft serve`'s default ports,
# which deploy/k8s declares too (tests/test_k8s.py checks all three agree)
EXPOSE 8000 8001 8002 9000
# `paradraft serve` drains on SIGTERM (--drain-seconds); Kubernetes and `docker stop` send it
STOPSIGNAL SIGTERM
# Serve an engine dir mounted at /engines (`paradraft build --out /engines ...`). The
# legacy TensorRT-LLM deployment (`--trtllm-engine-legacy`) is served by its serve_trtllm.sh;
# the >= 1.3 one from the `trtllm` stage.
CMD ["paradraft", "serve", "--engines", "/engines", "--host", "0.0.0.0"]
