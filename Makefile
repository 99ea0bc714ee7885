# Two commands set up a fresh machine and do the work: `make demo` and `make test`.
# The virtual environment lives in .venv and is (re)built only when the pinned requirements change.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed
OUT    ?= demo_out
PYTEST_ARGS ?=
TEST_JOBS ?= 2
BENCH_OUT ?= bench_out

.PHONY: env demo test browser upstream-check lint bench clean

env: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt requirements/mindformers-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch 2.13.0 CPU build and mindspore 2.10.0 (needs numpy<2) share one environment.
	$(PIP) install -q -c requirements/constraints.txt torch==2.13.0 mindspore==2.10.0 "numpy<2"
	# megatron-core and mindformers pin things this machine cannot have: install them bare ...
	$(PIP) install -q --no-deps megatron-core==0.16.1 mindformers==2.1.0
	# ... then what they really need, under the same constraints.
	$(PIP) install -q -c requirements/constraints.txt packaging -r requirements/mindformers-deps.txt
	$(PIP) install -q -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m align demo --out $(OUT)

test: $(STAMP)
	$(PY) -m ruff check core runstore mapping models sources checkpoints dumpers comparators reports align demo tests benchmarks
	# two workers, one test file each at a time (a file's shared runs are made once): 12 min on 2 cores (752 tests,
	# clean clone, 2026-11-28 18:11 UTC; 14m34s with the environment)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# The browser tests (report.html in headless Chromium) need Debian's chromium; without it they skip
# (`.ci/run` sets XF_ALIGN_REQUIRE_BROWSER=1, where they fail instead). Quick when it is already there.
browser:
	@if b=$$(command -v chromium || command -v chromium-browser); then \
		echo "browser: $$b is installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "browser: installing Debian's chromium (apt-get, ~120 MB)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; \
	else \
		echo "browser: chromium is missing and cannot be installed here (needs root and apt-get);" \
			"run 'sudo apt-get install chromium' (Debian/Ubuntu), or the browser tests skip" >&2; \
		exit 1; \
	fi

# By hand (CI cannot download upstream code): real Megatron-LM pretrain_gpt.py and, with MINDFORMERS_SRC, real
# MindFormers run_mindformer.py on CPU, dumped, converted and compared (tests/upstream/check.py).
UPSTREAM_OUT ?= upstream_out
upstream-check: $(STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "usage: make upstream-check MEGATRON_LM=DIR [MINDFORMERS_SRC=DIR]" >&2; exit 2; }
	PYTHONPATH=$(CURDIR) $(PY) tests/upstream/check.py --megatron-lm $(MEGATRON_LM) \
		$(if $(MINDFORMERS_SRC),--mindformers $(MINDFORMERS_SRC)) --out $(UPSTREAM_OUT)

# Issue 28's goals, each measured side by side in one run (~15-20 min on 2 quiet cores). The fresh-clone
# `make demo` / `make test` times are measured by hand and given as $(BENCH_OUT)/fresh_clone.json
# ({"make_demo_s": S, "make_test_s": S}); without it their rows say "not measured".
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) benchmarks/bench_logs.py --json $(BENCH_OUT)/logs.json
	$(PY) benchmarks/bench_tensor_compare.py --json $(BENCH_OUT)/tensors.json
	$(PY) benchmarks/bench_scale.py --json $(BENCH_OUT)/scale.json
	# msprobe side by side: its own environment (benchmarks/.venv-msprobe, never a product dependency).
	# Without msprobe the comparison still runs our side in .venv and says why msprobe is missing.
	@if PYTHON=$(PYTHON) bash benchmarks/msprobe_env.sh; then \
		benchmarks/.venv-msprobe/bin/python benchmarks/bench_vs_msprobe.py --json $(BENCH_OUT)/msprobe.json; \
	else \
		echo "bench: msprobe could not be installed (reason above); timing this toolkit only"; \
		$(PY) benchmarks/bench_vs_msprobe.py --json $(BENCH_OUT)/msprobe.json; \
	fi
	# issue 28: every goal side by side, from the JSON files above
	$(PY) benchmarks/summary.py --logs $(BENCH_OUT)/logs.json --msprobe $(BENCH_OUT)/msprobe.json \
		--tensors $(BENCH_OUT)/tensors.json --scale $(BENCH_OUT)/scale.json --fresh $(BENCH_OUT)/fresh_clone.json

clean:
	rm -rf $(VENV) $(OUT)
