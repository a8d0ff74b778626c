# Two commands on a fresh machine with only python3:  `make test`  and  `make book`.
# Both create .venv and install the project into it first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on this project's machines; `make TORCH=torch test` takes your platform's default.
TORCH  ?= torch==2.13.0
MATHJAX := _mathjax/mathjax/tex-chtml.js

.PHONY: corpus-prose corpus-stdlib311 results-long-b4 results-long-b4-cpu results-prose test test-fast test-notebooks book notebooks mathjax env results-cpu results-amplitude results-article results-long results-retrieval results-tasks results-context results-context-long results-context-long-b4 results-context-prose results-context-variants results-variants results-recent results-past-softmax results-context-past-softmax results-digits-past-softmax results-context-recent results-digits-recent benchmarks-cpu clean

env: $(VENV)/.installed

# copy a finished run's config, tables and units (and the files named in $(2)) into results/$(1)
define commit_run
rm -rf results/$(1) && mkdir -p results/$(1) && \
  cp -r runs/$(1)/config.json runs/$(1)/results.csv runs/$(1)/results.json runs/$(1)/units \
  $(addprefix runs/$(1)/,$(2)) results/$(1)/
endef
# float16 weights of seed 0 of the article's encodings, for chapter 9's diagnostics and chapter 4's generation
define export_seed0
$(PY) -c "from posenc_lab.lab import results; results.export_models('runs/$(1)', '$(1)', \
  ['nope', 'sinusoidal', 'rope', 'alibi', 't5'])"
endef

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,lab,book]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# every test: the package's numerics, the experiment, every notebook (each run alone as Colab opens it, its
# outputs compared by nbval), the .md/.ipynb pairing, the Colab install cell, the built book in a headless browser;
# the slowest tests are listed at the end
test: env mathjax
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# nbval on every chapter in .venv, cell by cell (make test runs each chapter alone instead)
test-notebooks: env
	$(PY) -m pytest -q notebooks

# the quick subset: no training, no book build (a test that trains fails here until it is marked slow); one worker per core
test-fast: env
	$(PY) -m pytest -q -m "not slow" -n auto tests

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

# the committed CPU experiments (two cores, nothing else running): the quick picture and its fine-tune
# (about 35 minutes), the article's lengths with three seeds (about 2 hours), retrieval (under an hour)
results-cpu: env
	$(PY) -m posenc_lab run --preset cpu --out runs/cpu
	$(PY) -m posenc_lab run --preset cpu --encodings rope --finetune pi,ntk,yarn --finetune-steps 200 --finetune-len 512 --out runs/cpu-finetune
	for run in cpu cpu-finetune; do rm -rf results/$$run && mkdir -p results/$$run && \
	  cp -r runs/$$run/config.json runs/$$run/results.* runs/$$run/units runs/$$run/figures results/$$run/; done

results-retrieval: env
	$(PY) -m posenc_lab retrieval --preset retrieval-cpu --out runs/retrieval-cpu
	$(call commit_run,retrieval-cpu)

# the retrieval tasks that need positions (chapter 9): five digits in order, 4,000 steps (about 75 minutes on two
# quiet cores); TASKS="digits multikey" adds the named key among distractors, 8,000 steps with untied embeddings
# (about 5.5 hours; the book's appendix says how its design was chosen); the article's encodings, three seeds each; seed 0's
# weights are kept as float16 (scripts/answer_digits.py reads them)
TASKS ?= digits
results-tasks: env
	$(foreach task,$(TASKS),$(PY) -m posenc_lab retrieval --preset retrieval-$(task)-cpu --out runs/retrieval-$(task)-cpu && \
	  $(call commit_run,retrieval-$(task)-cpu) && $(call export_seed0,retrieval-$(task)-cpu) && ) true

# the context experiment on article-cpu's models (chapter 9; inference only, about 45 minutes): needs the weights
# of every seed in runs/article-cpu/models, which only the machine that trained them has (run results-article first);
# units finished before a new column was added keep their rows (remove runs/context-cpu/units to measure it)
results-context: env
	$(PY) -m posenc_lab context --preset context-cpu --run runs/article-cpu --out runs/context-cpu
	rm -rf results/context-cpu && mkdir -p results/context-cpu && \
	  cp -r runs/context-cpu/*.csv runs/context-cpu/*.json runs/context-cpu/units results/context-cpu/

# the same on article-long's models (44 minutes): needs every seed's weights in runs/article-long/models, which
# make results-long leaves there (results/article-long/models keeps seed 0's only)
# $(call context_on,RUN,PRESET): the context preset PRESET on RUN's models (the run's folder restored from results/
# where it is missing), its tables to results/PRESET
define context_on
	mkdir -p runs/$(1)/models
	test -f runs/$(1)/config.json || cp -r results/$(1)/. runs/$(1)/
	$(PY) -m posenc_lab context --preset $(2) --run runs/$(1) --out runs/$(2) $(3)
	rm -rf results/$(2) && mkdir -p results/$(2) && \
	  cp -r runs/$(2)/*.csv runs/$(2)/*.json runs/$(2)/units results/$(2)/
endef

results-context-long: env
	$(call context_on,article-long,context-long)

# the same on the headline's models (article-long-b4) and on the prose models (prose-long-b4, no passkey); every
# seed's weights in runs/<run>/models, which make results-long-b4 / results-prose leave there. On one H200 with
# JOBS=15 the two took 5 minutes side by side
results-context-long-b4: env
	$(call context_on,article-long-b4,context-long-b4,--jobs $(JOBS))
results-context-prose: env corpus-prose
	$(call context_on,prose-long-b4,context-prose-long-b4,--jobs $(JOBS) --corpus prose:$(PROSE))

# the gain from context past 512 on variants-cpu's models (9 minutes): every seed's weights in
# runs/variants-cpu/models, which make results-variants leaves there
results-context-variants: env
	$(call context_on,variants-cpu,context-variants)

# what today's models run (chapter 12): seven variants and plain RoPE (with Llama 3's scaling) with article-cpu's
# recipe, three seeds each (about 2 hours 15 minutes on two quiet cores)
results-variants: env
	$(PY) -m posenc_lab run --preset variants-cpu --out runs/variants-cpu
	$(call commit_run,variants-cpu,documents.csv)

# what 2024-26 added: nine methods with article-cpu's recipe, three seeds each (many hours on two cores; it resumes)
results-recent: env
	$(PY) -m posenc_lab run --preset recent-cpu --out runs/recent-cpu
	$(call commit_run,recent-cpu,documents.csv)

# stick-breaking, PaTH and DAPE on KERPLE under recent-cpu's recipe (about 4 h of training on 2 cores, and the
# evaluation to 8,192): it resumes where it stopped
results-past-softmax: env
	$(PY) -m posenc_lab run --preset past-softmax-cpu --out runs/past-softmax-cpu
	$(call commit_run,past-softmax-cpu,documents.csv)

# the gain from context past 512 (after results-past-softmax: it reads that run's models), and the digits task,
# for the same three methods
results-context-past-softmax: env
	$(call context_on,past-softmax-cpu,context-past-softmax)

results-digits-past-softmax: env
	$(PY) -m posenc_lab retrieval --preset retrieval-digits-past-softmax --out runs/retrieval-digits-past-softmax
	$(call commit_run,retrieval-digits-past-softmax)
	$(PY) -c "from posenc_lab.lab import results; [results.export_models('runs/retrieval-digits-past-softmax', \
	  'retrieval-digits-past-softmax', ['stick-breaking'], seed=s) for s in (0, 1, 2)]"

# the gain from context past 512 on recent-cpu's models (every seed's weights in runs/recent-cpu/models)
results-context-recent: env
	$(call context_on,recent-cpu,context-recent)

# the digits task (chapter 9's) for FoX, CoPE, SSMax on RoPE and Gemma 3's layers, three seeds
results-digits-recent: env
	$(PY) -m posenc_lab retrieval --preset retrieval-digits-recent --out runs/retrieval-digits-recent
	$(call commit_run,retrieval-digits-recent)
	$(PY) -c "from posenc_lab.lab import results; [results.export_models('runs/retrieval-digits-recent', \
	  'retrieval-digits-recent', ['fox'], seed=s) for s in (0, 1, 2)]"

# the old small-amplitude sinusoids with article-cpu's recipe, seed 0 (chapter 8's amplitude comparison; ~8 minutes)
results-amplitude: env
	$(PY) -m posenc_lab run --preset amplitude-cpu --out runs/amplitude-cpu
	$(call commit_run,amplitude-cpu,documents.csv checkpoints.csv)

results-article: env
	$(PY) -m posenc_lab run --preset article-cpu --out runs/article-cpu
	$(call commit_run,article-cpu,documents.csv checkpoints.csv figures)
	$(call export_seed0,article-cpu)

# article-long (issue 20): article-cpu's recipe with 4x the tokens for the article's encodings, three seeds; many
# hours on two cores (it resumes where it stopped; book/running.md says how to move a run between machines)
results-long: env
	$(PY) -m posenc_lab run --preset article-long --out runs/article-long
	$(call commit_run,article-long,documents.csv checkpoints.csv figures)
	$(call export_seed0,article-long)

# the headline recipe: article-long's model and tokens in batches of 4 for 5,600 steps. On two CPU cores about 20
# minutes a unit (5 hours); on a GPU the units run side by side: JOBS=15 took under 5 minutes on one H200
JOBS ?= 1
RUN_FLAGS ?=
results-long-b4: env
	$(PY) -m posenc_lab run --preset article-long-b4 --jobs $(JOBS) $(RUN_FLAGS) --out runs/article-long-b4
	$(call commit_run,article-long-b4,documents.csv checkpoints.csv)
	$(call export_seed0,article-long-b4)

# the device's effect (chapter 10): ALiBi and T5 with seed 0 of the headline recipe trained again on the CPU (about
# 35 minutes each on two cores)
results-long-b4-cpu: env
	$(PY) -m posenc_lab run --preset article-long-b4 --seeds 0 --encodings alibi,t5 --no-report --out runs/article-long-b4-cpu
	$(call commit_run,article-long-b4-cpu,documents.csv)

# English prose for the same recipes, offline: two public-domain Debian packages (Jane Austen's novels in
# r-cran-janeaustenr, the World English Bible in sword-text-web), unpacked into .corpus/prose without installing R
PROSE := .corpus/prose
# the Python corpus for a machine whose Python is not 3.11.7 (a lent GPU): 3.11.7's standard library sources as a
# tarball, made from this machine's Python (scripts/device_article_shape.sh and device_seeds.sh unpack it)
corpus-stdlib311: env
	$(PY) -c "import sys; sys.exit(0 if sys.version.split()[0] == '3.11.7' else 'needs Python 3.11.7, not ' + sys.version.split()[0])"
	mkdir -p .corpus/stdlib311
	tar czf .corpus/stdlib311/lib.tar.gz --exclude=site-packages --exclude=__pycache__ --exclude='*.so' \
	  -C "$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")" .

corpus-prose: $(PROSE)/engWEB2015eb/ot.bzz
$(PROSE)/engWEB2015eb/ot.bzz:
	rm -rf .corpus/debs && mkdir -p .corpus/debs $(PROSE)/janeaustenr $(PROSE)/engWEB2015eb
	cd .corpus/debs && apt-get download r-cran-janeaustenr sword-text-web
	for deb in .corpus/debs/*.deb; do dpkg -x $$deb .corpus/debs/root; done
	cp .corpus/debs/root/usr/lib/R/site-library/janeaustenr/data/Rdata.rd? $(PROSE)/janeaustenr/
	cp .corpus/debs/root/usr/share/sword/modules/texts/ztext/engWEB2015eb/* $(PROSE)/engWEB2015eb/
	rm -rf .corpus/debs

# both recipes on the prose (6 hours on two CPU cores; JOBS=15 on a GPU); then the article-long-b4-style tables
results-prose: env corpus-prose
	for run in prose-long-b4 prose-long; do \
	  $(PY) -m posenc_lab run --preset $$run --corpus prose:$(PROSE) --jobs $(JOBS) $(RUN_FLAGS) --out runs/$$run && \
	  $(call commit_run,$$run,documents.csv checkpoints.csv) && $(call export_seed0,$$run) || exit 1; done

# the committed CPU benchmarks (about 15 minutes on two cores, nothing else running); the peer
# comparison installs x-transformers, a benchmark-only dependency
benchmarks-cpu: env
	$(PY) benchmarks/attention.py --lengths 512,1024,2048 --train-len 512 --heads 8 --head-dim 64 --reps 5 --json results/benchmarks/cpu-attention.json
	$(PY) benchmarks/train_throughput.py --n-layer 4 --d-model 128 --n-head 4 --seq-len 512 --batch 4 --reps 10 --rounds 5 --json results/benchmarks/cpu-train.json
	$(PY) benchmarks/train_throughput.py --encodings nope,rope,alibi,ssmax,ssmax-rope,nope-temp,irope,gemma3,rnope-swa,fope,fox,cope \
	  --n-layer 4 --n-head 4 --d-model 128 --seq-len 512 --batch 8 --no-compile --warmup 2 --reps 5 --rounds 2 --no-progress \
	  --json results/benchmarks/cpu-train-recent.json
	$(PY) benchmarks/train_throughput.py --encodings nope,kerple,stick-breaking,path,dape-kerple \
	  --n-layer 4 --n-head 4 --d-model 128 --seq-len 512 --batch 8 --no-compile --warmup 2 --reps 5 --rounds 2 --no-progress \
	  --json results/benchmarks/cpu-train-past-softmax.json
	$(PY) benchmarks/step.py --json results/benchmarks/cpu-step.json
	$(PY) benchmarks/long_eval.py --lengths 1024,2048,4096,8192 --reps 3 --rounds 2 --json results/benchmarks/cpu-long-eval.json
	$(PY) benchmarks/long_eval.py --device cpu --encodings nope,rope,alibi,ssmax-rope,irope,gemma3,rnope-swa,fope,fox,cope \
	  --lengths 4096 --reps 3 --rounds 1 --no-progress --json results/benchmarks/cpu-long-eval-recent.json
	$(PY) benchmarks/long_eval.py --device cpu --encodings nope,kerple,stick-breaking,path,dape-kerple \
	  --lengths 4096,8192 --reps 2 --rounds 1 --no-progress --json results/benchmarks/cpu-long-eval-past-softmax.json
	$(PY) benchmarks/levers.py --json results/benchmarks/cpu-levers.json
	$(PY) benchmarks/generate.py --json results/benchmarks/cpu-generate.json
	$(PY) -m pip install -q -e ".[peer]"
	$(PY) benchmarks/peer.py --rounds 4 --json results/benchmarks/cpu-peer.json

clean:
	rm -rf _build .pytest_cache
