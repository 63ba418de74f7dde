#!/usr/bin/env bash
# Install the real peer routers (prebuilt Rust wheels from PyPI, pinned to the versions the
# tests were written against) into a venv, for
# tests/system/test_peer_routers.py. Idempotent: pip skips what is already installed.
#   usage: scripts/install_peers.sh [VENV_DIR]   (default: .venv)
set -euo pipefail
venv="${1:-.venv}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "sglang-router==0.3.2" "vllm-router==0.1.17"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("sglang-router", "vllm-router"):
    print(f"{name} {md.version(name)}")
PY
