# plait — the two commands of the quickstart are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The distributions of this repository, in dependency order.
DISTS := core libs/testing libs/algorithms libs/hf libs/weights libs/train libs/server sdk plugins/torch plugins/fsdp2 plugins/megatron plugins/vllm plugins/sglang envs/math envs/docker renderers/qwen plugins/proxy plugins/tinker plugins/remote plugins/sinks examples/plugins/openai_engine examples/plugins/countdown_env examples/plugins/csv_sink examples/plugins/median_baseline

.PHONY: help venv demo demo-tiny test check lint bench clean

help:
	@echo "make demo   - install everything into $(VENV) and run the main example (GRPO on SmolLM2-135M, ~3 min after set-up)"
	@echo "make demo-tiny - the test-sized run: a tiny Qwen3 learns a strict answer format (~3 min)"
	@echo "make test   - install everything and run the whole test suite (what CI runs)"
	@echo "make check  - the fast default suite (run before every commit)"
	@echo "make lint   - ruff format and check, the core size, the docs links, the import contracts, mypy on every distribution"
	@echo "make bench  - the benchmarks (JSON in benchmarks/results/)"

$(VENV)/.installed: $(foreach d,$(DISTS),$(d)/pyproject.toml) scripts/install.sh
	VENV=$(VENV) PYTHON=$(PYTHON) DISTS="$(DISTS)" bash scripts/install.sh
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/plait run examples/arith_smollm2.toml

demo-tiny: venv
	$(VENV)/bin/plait run examples/arith_tiny.toml

test: venv
	bash scripts/test.sh

check: venv
	bash scripts/test.sh --fast

lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint/core_size.py
	$(PY) scripts/lint/docs_links.py
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

bench: venv
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .tox runs benchmarks/results/*.json
