#!/usr/bin/env bash
# Build torchsort's C++ extension against the torch already in the active environment.
#
# torchsort's setup.py adds a CUDA kernel whenever `nvcc` is on PATH. On machines that ship
# nvcc without a linkable CUDA runtime (our CPU CI boxes) that build fails, so we try CUDA
# only when torch itself sees a GPU, and otherwise (or when the CUDA build fails) build the
# CPU-only extension by hiding nvcc from PATH. The script says which one it built. Each build is
# kept as a wheel (scripts/wheel_cache.py: keyed by torchsort's and torch's versions, Python and
# the variant), so that a new clone on the same machine installs it in seconds.
set -euo pipefail
VERSION="${1:?usage: install_torchsort.sh VERSION}"
PY="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pip_install() { "$PY" "$HERE/wheel_cache.py" "torchsort==$VERSION" --variant "$1"; }

if command -v nvcc >/dev/null 2>&1 && "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "torchsort: nvcc and a CUDA device found, building the CUDA + CPU extension"
  if pip_install cuda; then
    "$PY" -c 'import torchsort.isotonic_cuda' && { echo "torchsort: built with CUDA"; exit 0; }
  fi
  echo "torchsort: CUDA build failed, falling back to the CPU-only build"
fi
# Hide every nvcc from PATH so that setup.py builds the CPU extension only.
CLEAN_PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd:)
PATH="$CLEAN_PATH" pip_install cpu
"$PY" -c 'import torch, torchsort; torchsort.soft_rank(torch.tensor([[3.0, 1.0, 2.0]]))'
echo "torchsort: CPU-only"
