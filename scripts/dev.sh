#!/usr/bin/env bash
# Set up the project's virtual environment (idempotent) and run one task.
#   scripts/dev.sh demo          install, then run `torch-tweak demo`
#   scripts/dev.sh test [ARGS]   install, then run ruff and the test suite (extra ARGS go to pytest)
#   scripts/dev.sh setup         install only
set -euo pipefail
cd "$(dirname "$0")/.."
task="${1:-setup}"
shift || true

if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
# torch first, pinned: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[openvino,torchao,onnxruntime,nncf,hf,report,signing,test]" "torch==2.13.0"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1

case "$task" in
    setup) ;;
    demo) .venv/bin/torch-tweak demo "$@" ;;
    test)
        .venv/bin/ruff check torch_tweak tests benchmarks examples
        .venv/bin/python -m pytest -q "$@"
        ;;
    *) echo "unknown task '$task' (use setup, demo or test)" >&2; exit 2 ;;
esac
