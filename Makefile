# Two commands set up a fresh machine and do the work: `make demo` and `make test`.
# The virtual environment lives in .venv and is (re)built only when the pinned requirements change: $(STAMP) holds
# what `make demo` needs (the frameworks, this toolkit), $(DEV_STAMP) adds what `make test` needs.
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# no byte-compiling at install: pip compiles all ~18,000 modules of the wheels one by one; Python compiles the
# few thousand a run imports on first use
PIP_INSTALL := $(PIP) install --no-compile
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
REQUIREMENTS := pyproject.toml requirements/constraints.txt requirements/mindformers-deps.txt
OUT    ?= demo_out
PYTEST_ARGS ?=
TEST_JOBS ?= 2
BENCH_OUT ?= bench_out
# pip's own lines while it resolves and installs, condensed to a line every 20 packages found and one when it
# unpacks; anything else it says (a warning, an error) is shown as it comes
PIP_PROGRESS = awk -v step="$(1)" '\
	/^(Collecting|Processing) / { n++; if (n % 20 == 0) { printf "env %s: %d packages found ...\n", step, n; fflush() } next } \
	/^Installing collected packages:/ { k = gsub(/,/, ","); \
		printf "env %s: %d packages found; installing %d of them ...\n", step, n, k + 1; fflush(); next } \
	/^(Requirement already satisfied|Using cached|Downloading|Obtaining|Preparing|Building|Created wheel|Stored in|Installing build|Getting requirements|Checking if build|Attempting uninstall|Found existing|Uninstalling|Successfully|Looking in|  |$$)/ { next } \
	{ print; fflush() }'
# how long since $$t (set by the recipe line)
SINCE = $$(( $$(date +%s) - t )) s

.PHONY: env demo test browser upstream-check lint bench clean

env: $(STAMP)

# Three pip calls. megatron-core 0.16.1 and mindformers 2.1.0 come last and without their dependencies:
# mindformers pins mindspore~=2.11 and hyper-parallel, neither installable here (README, requirements/), so pip is
# never asked to resolve it (a resolve with it installed prints pip's red "dependency resolver" error); a rebuild
# takes both out first for the same reason.
$(STAMP): $(REQUIREMENTS)
	@t=$$(date +%s); test -x $(PY) || { echo "env 1/3: a new virtual environment in $(VENV) and the latest pip (~10 s)"; \
		$(PYTHON) -m venv $(VENV) && $(PIP) install -q --upgrade pip && echo "env 1/3: done in $(SINCE)"; }
	@rm -f $(STAMP) $(DEV_STAMP); if $(PIP) show -q mindformers megatron-core >/dev/null 2>&1; then \
		$(PIP) uninstall -q -y mindformers megatron-core; fi
	@echo "env 2/3: torch 2.13.0 (CPU build), mindspore 2.10.0, mindformers' requirements and this toolkit:" \
		"~100 packages, ~1.5 GB of wheels (1.5-3 min on 2 cores; most of it finding packages, then unpacking)"
	@t=$$(date +%s); $(PIP_INSTALL) -c requirements/constraints.txt torch==2.13.0 mindspore==2.10.0 "numpy<2" packaging \
		-r requirements/mindformers-deps.txt -e . 2>&1 | $(call PIP_PROGRESS,2/3) && echo "env 2/3: done in $(SINCE)"
	@echo "env 3/3: megatron-core 0.16.1 and mindformers 2.1.0 with --no-deps (~5 s): mindformers pins mindspore~=2.11" \
		"and hyper-parallel, neither installable here; what it really needs came in step 2"
	@t=$$(date +%s); $(PIP_INSTALL) -q --no-deps megatron-core==0.16.1 mindformers==2.1.0 && echo "env 3/3: done in $(SINCE)"
	@touch $(STAMP)

# pytest, ruff and the optional extras the tests cover (tensorboard, dask, pyarrow)
$(DEV_STAMP): $(STAMP)
	@echo "env: the test tools (pytest, ruff, tensorboard, dask; ~20 s)"
	@t=$$(date +%s); $(PIP_INSTALL) -c requirements/constraints.txt -e '.[dev]' 2>&1 | $(call PIP_PROGRESS,dev) && \
		echo "env: test tools done in $(SINCE)"
	@touch $(DEV_STAMP)

demo: $(STAMP)
	$(PY) -m align demo --out $(OUT)

test: $(DEV_STAMP)
	$(PY) -m ruff check core runstore mapping models sources checkpoints dumpers comparators reports align demo tests benchmarks
	# two workers, one test file each at a time, longest files first (tests/conftest.py; a file's shared runs are
	# made once, its fault pairs' runs share framework processes: demo/fault_batch.py): 17 min on 2 cores in a warm
	# checkout (1107 tests, 1981 CPU-s, load 0.1-8 from other jobs, 2026-11-29 13:00 UTC), above the 10-minute aim:
	# the paired demos and MindSpore launches (tests/test_demo*.py, test_mindformers_launch.py,
	# test_replay_layout_msrun.py) are most of it
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
# MindFormers run_mindformer.py on CPU, dumped, converted and compared (tests/upstream/check.py). Rows: the dense
# DP=1 baseline (and its pair with the dense example YAML), a TP=2 dense baseline, the MoE baseline at EP=2 (and
# its pair with the MoE example YAML, replayed DP 2 -> 1), the EP=2 MoE with router losses; UPSTREAM_ONLY=dense,tp2,moe,
# moe_losses picks some.
UPSTREAM_OUT ?= upstream_out
upstream-check: $(STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "usage: make upstream-check MEGATRON_LM=DIR [MINDFORMERS_SRC=DIR]" >&2; exit 2; }
	PYTHONPATH=$(CURDIR) $(PY) tests/upstream/check.py --megatron-lm $(MEGATRON_LM) \
		$(if $(MINDFORMERS_SRC),--mindformers $(MINDFORMERS_SRC)) $(if $(UPSTREAM_ONLY),--only $(UPSTREAM_ONLY)) \
		--out $(UPSTREAM_OUT)

# Issue 28's goals, each measured side by side in one run (~15-20 min on 2 quiet cores). The fresh-clone
# `make demo` / `make test` times are measured by hand and given as $(BENCH_OUT)/fresh_clone.json
# ({"make_demo_s": S, "make_test_s": S}); without it their rows say "not measured".
bench: $(DEV_STAMP)
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
