#!/usr/bin/env bash
# Install the pinned torch into the given python's environment without ever pulling a CUDA
# build onto a machine that has no NVIDIA GPU.
#   scripts/install_torch.sh PYTHON VERSION
# TORCH_INDEX_URL, when set, is used as the index for torch (e.g. a CPU wheel index).
set -euo pipefail
py=$1
version=$2

if "$py" -c "import sys, torch; sys.exit(0 if torch.__version__.split('+')[0] == '$version' else 1)" 2>/dev/null; then
  exit 0  # already there
fi

index_args=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  index_args=(--index-url "$TORCH_INDEX_URL")
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=1
fi

if [ "$has_gpu" = 0 ] && [ "$(uname -s)" = Linux ] && [ -z "${TORCH_INDEX_URL:-}" ]; then
  # Resolve first (metadata only) and refuse a CUDA build on a CPU-only machine.
  resolved=$("$py" -m pip install --dry-run --quiet --report - "torch==$version" 2>/dev/null |
    "$py" -c "import json, sys; r = json.load(sys.stdin); print(next(i['metadata']['version'] for i in r['install'] if i['metadata']['name'] == 'torch'))")
  case "$resolved" in
    *+cpu) ;;
    *)
      echo "install_torch: this machine has no NVIDIA GPU, but torch==$version resolves to '$resolved'," >&2
      echo "which is a CUDA build (several GB). Set TORCH_INDEX_URL to a CPU wheel index and retry." >&2
      exit 1
      ;;
  esac
fi

"$py" -m pip install "torch==$version" "${index_args[@]}"
