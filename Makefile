# The two set-up commands of the README: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.daftrain-installed
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

.PHONY: demo test test-all bench data env clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Real Fashion-MNIST from Debian's package; without root the loaders fall back and say so.
data:
	@test -f $(FMNIST) || { if [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null \
	  || echo "note: could not install dataset-fashion-mnist"; \
	else echo "note: run 'sudo apt-get install dataset-fashion-mnist' for the real data set"; fi; }

demo: $(STAMP) data
	$(VENV)/bin/daftrain demo

test: $(STAMP) data
	$(PY) -m pytest -q

test-all: $(STAMP) data
	$(PY) -m pytest -q -m ""

env: $(STAMP)
	$(VENV)/bin/daftrain env

clean:
	rm -rf $(VENV) .pytest_cache build dist src/*.egg-info
