# Two entry points: `make demo` and `make test`. Each creates (or refreshes) .venv and installs what it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test bench clean

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e .
	touch $@

$(VENV)/.test: $(VENV)/.core pyproject.toml
	$(PIP) install -e ".[test]"
	touch $@

demo: $(VENV)/.core
	$(PY) -m hypic_jax.demo --families

test: $(VENV)/.test
	$(PY) -m pytest -n auto -q tests

bench: $(VENV)/.core
	$(PY) bench/linear_attn.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
