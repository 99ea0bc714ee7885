#!/usr/bin/env bash
# Build benchmarks/.venv-msprobe: a separate environment holding msprobe (mindstudio-probe) next to torch and
# megatron-core, so `make bench` can time msprobe against this toolkit on the same model in the same
# interpreter. It is never a dependency of the product (the product's own environment is .venv).
#
# Idempotent: a stamp file records a finished install; delete it (or the venv) to rebuild.
# Exit status: 0 when the environment is ready, 3 when msprobe could not be installed (the reason is printed;
# `make bench` goes on without the comparison).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
VENV="${MSPROBE_VENV:-$HERE/.venv-msprobe}"
PYTHON="${PYTHON:-python3}"
MSPROBE_SPEC="${MSPROBE_SPEC:-mindstudio-probe==26.2.0}"
STAMP="$VENV/.installed"
LOG="$VENV/install.log"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import msprobe, torch, megatron.core, dumpers" >/dev/null 2>&1; then
    echo "msprobe env: ready ($VENV)"
    exit 0
fi

fail() {
    echo "msprobe env: NOT available: $1" >&2
    [ -f "$LOG" ] && { echo "--- last lines of $LOG ---" >&2; tail -n 15 "$LOG" >&2; }
    exit 3
}

echo "msprobe env: building $VENV (log: $LOG)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV" || fail "could not create a venv with $PYTHON"
: > "$LOG"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
run() { echo "+ $*" >> "$LOG"; "$@" >> "$LOG" 2>&1; }

run "${PIP[@]}" install -q --upgrade pip || fail "pip upgrade failed"
# torch 2.13.0 resolves to the local CPU wheel (pip finds it through its local find-links); numpy<2 as in the product's environment.
run "${PIP[@]}" install -q torch==2.13.0 "numpy<2" || fail "torch 2.13.0 could not be installed"
# megatron-core pins things this machine cannot have: bare, then what it really needs.
run "${PIP[@]}" install -q --no-deps megatron-core==0.16.1 || fail "megatron-core 0.16.1 could not be installed"
run "${PIP[@]}" install -q packaging h5py pandas PyYAML psutil "numpy<2" || fail "h5py/pandas/PyYAML failed"
# msprobe itself, keeping torch and numpy where they are.
printf 'torch==2.13.0\nnumpy<2\n' > "$VENV/constraints.txt"
run "${PIP[@]}" install -q -c "$VENV/constraints.txt" "$MSPROBE_SPEC" \
    || fail "$MSPROBE_SPEC could not be installed from the package registry"
# This project, bare, so our dumper runs in the same interpreter as msprobe.
run "${PIP[@]}" install -q --no-deps -e "$ROOT" || fail "pip install -e $ROOT failed"
"$VENV/bin/python" -c "import msprobe, torch, megatron.core, dumpers, align, comparators" >> "$LOG" 2>&1 \
    || fail "imports failed in $VENV"
touch "$STAMP"
echo "msprobe env: ready ($VENV)"
