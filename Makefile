# Two entry points: `make demo` (the main job on the CPU) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint imports bench clean serve-deps

TRITON := $(VENV)/pytriton/pytriton/tritonserver/bin/tritonserver
PYTRITON := nvidia-pytriton==0.7.0

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The tritonserver binary (CPU) from the nvidia-pytriton wheel, unpacked into the venv without
# installing pytriton's Python package (it pins numpy < 2; the binary needs none of it).
$(TRITON): | $(STAMP)
	$(BIN)/pip download --quiet --no-deps $(PYTRITON) -d $(VENV)/wheels
	$(BIN)/python -m zipfile -e $(VENV)/wheels/nvidia_pytriton-*.whl $(VENV)/pytriton
	chmod +x $(TRITON) $(VENV)/pytriton/pytriton/tritonserver/python_backend_stubs/*/*

serve-deps: $(TRITON)

# The main job on the CPU: build the demo ONNX engines, start Triton with them, stream one
# completion over gRPC, print the stats, stop the server. The server takes its slot count
# from the engines' max_batch_size: 16, as many as `paradraft loadtest` runs at once.
ENGINES := engines/demo

$(ENGINES)/manifest.json: $(STAMP) $(wildcard models/demo/*/model.safetensors) build/onnx.py
	$(BIN)/paradraft build --backend onnx --max-batch-size 16 --out $(ENGINES)

demo: $(STAMP) $(TRITON) $(ENGINES)/manifest.json
	$(BIN)/paradraft demo --engines $(ENGINES) --prompt "def fibonacci(n):" --max-tokens 64

test: $(STAMP) $(TRITON) imports
	$(BIN)/ruff check .
	# pytest exit code 5 = no tests collected: say so and fail, never pass silently
	$(BIN)/python -m pytest -q tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: $(STAMP) imports
	$(BIN)/ruff check .

# The import contracts of pyproject.toml (import-linter). runtime/ and build/ are reached from
# paradraft/ through the links paradraft/runtime and paradraft/build, so grimp sees the tree
# laid out as the import names say.
imports: $(STAMP)
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
