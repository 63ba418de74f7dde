#!/usr/bin/env bash
# Install aiperf (PyPI, pinned) into its OWN venv: its dependency tree (transformers, zmq,
# pandas...) must not mix with the router's. Kept outside the clone so later runs on the same
# machine reuse it. Idempotent: pip skips what is already installed.
#   usage: scripts/install_aiperf.sh [VENV_DIR]
#   default VENV_DIR: $AIPERF_HOME or ~/.cache/disagg-router/aiperf
# tests/tools/test_aiperf.py finds it the same way (and skips, saying why, when it is absent).
set -euo pipefail
venv="${1:-${AIPERF_HOME:-${HOME:-/root}/.cache/disagg-router/aiperf}}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "aiperf==0.13.0"
"$venv/bin/aiperf" --version 2>/dev/null || "$venv/bin/python" -c \
  "import importlib.metadata as md; print('aiperf', md.version('aiperf'))"
