# Two commands on a fresh machine with only python3:  `make test`  and  `make book`.
# Both create .venv and install the project into it first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on this project's machines; `make TORCH=torch test` takes your platform's default.
TORCH  ?= torch==2.13.0
MATHJAX := _mathjax/mathjax/tex-chtml.js

.PHONY: test test-fast book notebooks mathjax env results-cpu benchmarks-cpu clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,book]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# every test: the package's numerics, the experiment, every notebook (nbval), the .md/.ipynb pairing,
# the Colab install cell, and the built book in a headless browser
test: env mathjax
	$(PY) -m pytest -q

# the quick subset: no training, no book build
test-fast: env
	$(PY) -m pytest -q -m "not slow" tests

mathjax: $(MATHJAX)
$(MATHJAX): book/fetch_mathjax.py
	$(PY) book/fetch_mathjax.py

book: env mathjax
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# execute every chapter and store its outputs in the paired .ipynb (run after editing a chapter's .md)
notebooks: env
	$(VENV)/bin/jupytext -q --set-formats ipynb,md:myst notebooks/*.md
	cd notebooks && for nb in *.ipynb; do ../$(VENV)/bin/jupyter execute --inplace "$$nb" || exit 1; done
	$(PY) book/strip_timings.py notebooks/*.ipynb
	$(VENV)/bin/jupytext -q --sync notebooks/*.ipynb

# the committed CPU experiment and benchmarks (about 30 and 10 minutes on two cores)
results-cpu: env
	$(PY) -m posenc_lab run --preset cpu --out runs/cpu
	rm -rf results/cpu && mkdir -p results/cpu && cp -r runs/cpu/config.json runs/cpu/results.* runs/cpu/units runs/cpu/figures results/cpu/

benchmarks-cpu: env
	$(PY) benchmarks/attention.py --lengths 512,1024,2048 --train-len 512 --heads 8 --head-dim 64 --reps 5 --json results/benchmarks/cpu-attention.json
	$(PY) benchmarks/train_throughput.py --n-layer 4 --d-model 256 --n-head 4 --seq-len 512 --batch 8 --reps 5 --json results/benchmarks/cpu-train.json

clean:
	rm -rf _build .pytest_cache
