# Fresh machine: `make demo` (whole pipeline on a locally made corpus, CPU) and `make test`.
# Every target creates or reuses ./.venv and installs only what is missing.

PYTHON ?= python3
VENV   ?= .venv
# The suite's torch: pyproject only asks torch>=2.5, but the test-time reference extra (ref:
# torchaudio, encodec, vocos, against which valle's own codecs are checked) needs the torchaudio
# of the same release, and torchaudio stopped at 2.11. `make smoke-newest-torch` covers the newest.
TORCH_VERSION ?= 2.9.1
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: install demo demo-long test smoke-newest-torch lint bench gpu-check oom-sweep clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch and torchaudio pinned together: torchaudio requires its own torch release exactly.
	$(PY) -m pip install -q -e '.[dev,eval,pinyin,ja,serve,vallex,browser,ref]' \
	    'torch==$(TORCH_VERSION)' 'torchaudio==$(TORCH_VERSION)'
	@touch $@

demo: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash egs/tiny/run.sh

# The demo's recipe for longer (docs/evaluation.md, "The long run"): 20,000 generated sentences,
# 20,000 AR and 2,750 NAR steps, 16 held-out items scored, then the curve over the AR epochs.
demo-long: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash egs/tiny/run.sh --generated 20000 \
	    --data data/gen20k/tokenized --exp exp/long20k --ar-epochs 100 --ar-max-steps 20000 \
	    --nar-epochs 100 --nar-max-steps 2750 --num-items 16
	$(PY) scripts/bench_quality.py --exp exp/long20k --data data/gen20k/tokenized --reuse --every 4

# Two pytest-xdist workers, each test file whole on one (its module fixtures built once; the
# held-out corpus is built by the first worker that needs it); the 25 slowest tests are listed.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

# The smoke set (tests marked `smoke`) in ./.venv-newtorch on the newest CPU torch, with
# valle's own requirements only (no torchaudio, encodec or vocos); SMOKE_TORCH=2.x.y for another.
smoke-newest-torch:
	PYTHON=$(PYTHON) bash scripts/smoke_newest_torch.sh

lint: install
	$(VENV)/bin/ruff check .

bench: install
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/bench.sh

# Fail every kind of allocation of a step, SQLite-style; tables into docs/oom.md.
oom-sweep: install
	$(PY) scripts/oom_sweep.py

# Every GPU check in one run; results under $$OUT (or ./out) and in docs/benchmarks.md form.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf egs/tiny/data egs/tiny/exp out
