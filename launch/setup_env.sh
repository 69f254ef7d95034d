#!/usr/bin/env bash
# Creates the virtual environment that `make demo` and `make test` use, on any fresh machine.
# Where no NVIDIA GPU is visible, torch comes as its CPU build (the CUDA build is several GB).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

"$python" - <<'PY' || { echo "prime needs Python >= 3.10; set PYTHON=/path/to/python3.x" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)
PY

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q --upgrade pip >/dev/null 2>&1 || true

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing the CUDA build of torch"
    $pip install -q "torch>=2.6,<2.15"
elif ! $venv/bin/python -c "import torch" >/dev/null 2>&1; then
    echo "setup: no GPU, installing the CPU build of torch"
    # A local label first (a wheel cache or mirror that carries it), then PyTorch's CPU index.
    $pip install -q "torch==2.13.0+cpu" 2>/dev/null \
        || $pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
$pip install -q -e ".[dev]"
echo "setup: ready ($($venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
