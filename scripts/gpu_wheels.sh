#!/usr/bin/env bash
# Fetch, on a machine with the package registry, the wheels scripts/gpu_check.sh installs on a GPU
# machine that has its own torch but not this project's optional packages (the lent H100/H200:
# Python 3.12, no registry). The versions are the ones installed in this checkout's .venv (what CI
# tests), the files go to .whl/ (ignored by git; send it along with the checkout).
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12)
#
# The set is each package with everything it needs that such a machine lacks: torchft imports
# its OpenTelemetry log exporter when it is imported, so the exporter's whole chain is here
# (a missing link there failed the fault-tolerance tests of a GPU check before).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
VENV_PY=${VENV_PY:-.venv/bin/python}
packages=(torchao torchdata tyro docstring-parser typeguard torchft xxhash
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-otlp-common opentelemetry-exporter-http-transport googleapis-common-protos)
pins=$("$VENV_PY" - "${packages[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass  # not needed by this version of its dependant
PY
)
mkdir -p .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086
"$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" -d .whl $pins
echo "wheels in .whl/:"
ls .whl
