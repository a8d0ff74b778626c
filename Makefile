# Two commands on a fresh machine with only python3:  `make test`  and  `make book`.
# Both create .venv and install the project into it first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on this project's machines; `make TORCH=torch test` takes your platform's default.
TORCH  ?= torch==2.13.0

.PHONY: test test-fast book env clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,book]"
	touch $@

# every test: the package's numerics, the experiment, the notebooks (nbval) and the book checks
test: env
	$(PY) -m pytest -q

test-fast: env
	$(PY) -m pytest -q -m "not slow"

book: env
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

clean:
	rm -rf _build .pytest_cache
