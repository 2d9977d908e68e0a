#!/usr/bin/env bash
# Set up the project's virtual environment (idempotent) and run one task.
#   scripts/dev.sh demo          install, then run `torch-tweak demo`
#   scripts/dev.sh test [ARGS]   install, then run ruff and the test suite on 2 workers (extra ARGS go to pytest;
#                                TT_TEST_WORKERS=0 runs it in one process)
#   scripts/dev.sh examples      install, then run every script under examples/ (fast mode where it has one)
#   scripts/dev.sh docs          install, then build the documentation site into site/ (warnings are errors)
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
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[openvino,torchao,onnxruntime,nncf,hf,report,signing,ray,test,docs]" "torch==2.13.0"
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1

case "$task" in
    setup) ;;
    demo) .venv/bin/torch-tweak demo "$@" ;;
    test)
        .venv/bin/ruff check torch_tweak tests benchmarks examples
        # Two workers (pytest-xdist), one test file each at a time: most of a test's time is single-threaded
        # tracing and compiling, so the 2-core machines run the suite in about two thirds of the time. Files keep
        # the order tests/conftest.py gives them (the ones with slow tests first), not xdist's by test count.
        .venv/bin/python -m pytest -q -n "${TT_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
        ;;
    examples)
        # Every example must be listed here with the arguments CI gives it.
        declare -A args=([sentence_embeddings.py]="--fast" [stable_diffusion.py]="--fast" [llm_generate.py]="")
        for path in examples/*.py; do
            name="$(basename "$path")"
            if [ -z "${args[$name]+set}" ]; then
                echo "examples/$name is not listed in scripts/dev.sh (examples task)" >&2; exit 1
            fi
            start=$(date +%s)
            # shellcheck disable=SC2086
            .venv/bin/python "$path" ${args[$name]} > "/tmp/example_${name%.py}.log" 2>&1 \
                || { tail -n 40 "/tmp/example_${name%.py}.log" >&2; echo "examples/$name failed" >&2; exit 1; }
            echo "examples/$name ${args[$name]}: passed in $(( $(date +%s) - start )) s"
        done
        ;;
    docs)
        # The documentation site (mkdocs.yml): warnings are errors, then every link of the built site is checked.
        .venv/bin/mkdocs build --strict --site-dir site
        .venv/bin/python tests/docs_links.py site
        ;;
    *) echo "unknown task '$task' (use setup, demo, test, examples or docs)" >&2; exit 2 ;;
esac
