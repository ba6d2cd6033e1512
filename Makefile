# make demo   — install (first time) and train the tiny GPT demo (~1 minute on 2 CPU cores; ARGS="--steps 50": its flags)
# make test   — install (first time) and run the whole test suite
# make docs   — build the documentation with mkdocs --strict
# make bench  — run the benchmarks (tables on stdout, JSON under benchmarks/results/)

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION := 2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test docs bench clean

$(STAMP): pyproject.toml constraints.txt scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	bash scripts/install_torch.sh $(PY) $(TORCH_VERSION)
	$(PY) -m pip install -c constraints.txt -e ".[dev,docs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/gpt/train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/step_cost.py
	$(PY) benchmarks/step_anatomy.py
	$(PY) benchmarks/loop_cache.py
	$(PY) benchmarks/parallel.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/compile.py
	$(PY) benchmarks/fsdp_prefetch.py
	$(PY) benchmarks/fp8.py
	$(PY) benchmarks/health.py
	$(PY) benchmarks/ft_recovery.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/data.py
	$(PY) benchmarks/step_path.py

clean:
	rm -rf $(VENV) site runs benchmarks/results
