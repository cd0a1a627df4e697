# Two entry points: `make demo` (the main job on the CPU) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/paradraft generate --prompt "def fibonacci(n):" --max-new-tokens 64 --k 4

test: $(STAMP)
	$(BIN)/ruff check .
	# exit code 5 = no tests collected: treated as a failure of the suite's layout, not a pass
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
