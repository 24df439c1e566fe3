#!/usr/bin/env bash
# Set up rdlm in ./.venv on a fresh machine: PyTorch (the CPU build unless an NVIDIA GPU is present),
# then rdlm itself with its test dependencies. Safe to run again; it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${RDLM_TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing torch==$TORCH_VERSION with CUDA"
        "${PIP[@]}" "torch==$TORCH_VERSION"
    else
        # Never pull the multi-GB CUDA wheels on a machine without a GPU. Where the default index
        # serves CUDA builds, point RDLM_TORCH_INDEX at a CPU-only index (e.g. PyTorch's /whl/cpu).
        echo "setup: no GPU, installing the CPU build of torch==$TORCH_VERSION"
        "${PIP[@]}" ${RDLM_TORCH_INDEX:+--index-url "$RDLM_TORCH_INDEX"} "torch==$TORCH_VERSION"
    fi
fi
"${PIP[@]}" -e ".[${RDLM_EXTRAS:-dev}]"
echo "setup: done ($(.venv/bin/python -c 'import torch, rdlm; print("torch", torch.__version__, "rdlm", rdlm.__version__)'))"
