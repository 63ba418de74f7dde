#!/usr/bin/env bash
# Prepare the real-SGLang test environment, idempotently: a separate venv with SGLang 0.5.23 on
# CPU (without its CUDA-only dependencies), the Debian libraries Mooncake's transfer engine links,
# and the tiny Llama model. Used by tests/real_sglang (see docs/real-sglang.md).
#
#   REAL_SGLANG_HOME   where everything goes (default: <repo>/.real-sglang, git-ignored)
#   REAL_SGLANG_PYTHON the interpreter to build the venv from (default: python3.11, then python3)
#
# Layout: $REAL_SGLANG_HOME/venv, $REAL_SGLANG_HOME/model. A run that finds both ready (stamp
# files) does nothing and takes about a second.
#
# Why --no-deps: `pip install sglang` pulls CUDA-only packages (flashinfer, flash-attn, deep-ep)
# that have no wheel for a CPU machine; scripts/sglang-cpu-requirements.txt is what SGLang 0.5.23
# needs on the CPU path (checked 2026-12-01). `sgl_kernel` is not installed at all: there is no
# CPU build on PyPI, and tests/real_sglang/engine_site/ provides the two ops this path calls.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

HOME_DIR="${REAL_SGLANG_HOME:-$REPO/.real-sglang}"
VENV="$HOME_DIR/venv"
MODEL="$HOME_DIR/model"
PY="$VENV/bin/python"

SGLANG_VERSION="0.5.23"
REQS="scripts/sglang-cpu-requirements.txt"
STAMP_VERSION="sglang=$SGLANG_VERSION reqs=$(sha1sum "$REQS" | cut -c1-12)"

log() { echo "prepare_real_sglang: $*"; }
mkdir -p "$HOME_DIR"

# Mooncake's transfer engine (mooncake-transfer-engine-non-cuda) links these, even over TCP.
missing=()
for lib in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$lib" >/dev/null 2>&1 || missing+=("$lib")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]} (apt-get)"
  SUDO=""
  [ "$(id -u)" = "0" ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

venv_ready() {
  [ -x "$PY" ] && [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$STAMP_VERSION" ]
}

if venv_ready; then
  log "venv ready at $VENV ($STAMP_VERSION)"
else
  t0=$SECONDS
  base="${REAL_SGLANG_PYTHON:-$(command -v python3.11 || command -v python3)}"
  log "creating venv at $VENV from $base"
  rm -rf "$VENV"
  "$base" -m venv "$VENV"
  pip_() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
      | { grep -v -e "is ignored: it is neither a file nor a directory" \
                  -e "Running pip as the 'root' user" || true; }
  }
  pip_ --upgrade pip
  log "installing SGLang's CPU requirements ($REQS)"
  pip_ -r "$REQS"
  log "installing sglang==$SGLANG_VERSION (--no-deps)"
  pip_ --no-deps "sglang==$SGLANG_VERSION"
  log "checking imports"
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$REPO/tests/real_sglang/engine_site" "$PY" - <<'PY'
import importlib.metadata as md
import torch, transformers  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401
from mooncake.engine import TransferEngine  # noqa: F401
print("prepare_real_sglang: sglang", md.version("sglang"), "torch", torch.__version__,
      "transformers", transformers.__version__,
      "mooncake", md.version("mooncake-transfer-engine-non-cuda"))
PY
  echo "$STAMP_VERSION" > "$VENV/.ready"
  log "venv ready in $((SECONDS - t0)) s"
fi

if [ -f "$MODEL/.ready" ] && [ "$(cat "$MODEL/.ready")" = "$(sha1sum scripts/build_tiny_model.py | cut -d' ' -f1)" ]; then
  log "model ready at $MODEL"
else
  t0=$SECONDS
  log "building the tiny model at $MODEL"
  rm -rf "$MODEL"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" scripts/build_tiny_model.py "$MODEL" 2>&1 \
    | { grep -v "Writing model shards" || true; }
  sha1sum scripts/build_tiny_model.py | cut -d' ' -f1 > "$MODEL/.ready"
  log "model ready in $((SECONDS - t0)) s"
fi
