#!/usr/bin/env bash
# Validates deploy/ offline (`make validate-deploy`; part of `make test`):
#  1. every manifest, and the kustomize output when kubectl is at hand, against the Kubernetes
#     OpenAPI schemas bundled in PyPI's kubernetes-validate, strictly (unknown fields are errors),
#     for the oldest and newest Kubernetes versions we support;
#  2. every env var the DaemonSet sets against the binary: it must be one that
#     `mbtunnel run --help` documents, or one reserved below for a component not merged yet.
# Ports, probes, scrape annotations, grace period and the ConfigMap's config are checked against
# the config parser and defaults by tests/deploy.rs (run by `cargo test`).
# kubernetes-validate is installed into a venv (VALIDATE_VENV) on first use; later runs reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/mbtunnel}
KV_VERSION=1.37.0
K8S_VERSIONS=${K8S_VERSIONS:-"1.29.0 1.37.0"}
VENV=${VALIDATE_VENV:-$PWD/target/validate-deploy-venv}
# Env vars the binary reads but `run --help` does not list (tests/deploy.rs checks them against
# mbtunnel::config::env). None today: every one is documented in `run --help`.
RESERVED_ENV=""

if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$KV_VERSION"; then
  echo "validate-deploy: installing kubernetes-validate $KV_VERSION into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KV_VERSION"
fi
PY="$VENV/bin/python"

manifests=()
for f in deploy/*.yaml; do [ "$(basename "$f")" = kustomization.yaml ] || manifests+=("$f"); done
rendered=""
if command -v kubectl >/dev/null && kubectl kustomize deploy/ >/dev/null 2>&1; then
  rendered=$(mktemp --suffix=.yaml)
  trap 'rm -f "$rendered"' EXIT
  kubectl kustomize deploy/ >"$rendered"
  manifests+=("$rendered")
else
  echo "validate-deploy: kubectl kustomize not available; validating the files one by one only"
fi
for v in $K8S_VERSIONS; do
  "$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "${manifests[@]}"
  echo "validate-deploy: ${#manifests[@]} manifest files valid against Kubernetes $v (strict)"
done

[ -x "$BIN" ] || { echo "validate-deploy: $BIN missing: run make build first" >&2; exit 1; }
HELP=$("$BIN" run --help)
"$PY" - "$RESERVED_ENV" "$HELP" deploy/daemonset.yaml <<'PYEOF'
import re, sys, yaml
reserved, help_text, path = sys.argv[1].split(), sys.argv[2], sys.argv[3]
documented = set(re.findall(r"\[env: ([A-Z0-9_]+)", help_text))
bad, used = [], []
for doc in yaml.safe_load_all(open(path)):
    if not doc or doc.get("kind") != "DaemonSet":
        continue
    spec = doc["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        for e in c.get("env", []):
            name = e["name"]
            used.append(name)
            if name in documented:
                if name in reserved:
                    print(f"validate-deploy: {name} is now documented by the binary; "
                          "drop it from RESERVED_ENV")
            elif name not in reserved:
                bad.append(f"{c['name']}: {name}")
if bad:
    sys.exit("validate-deploy: env vars the binary does not know (mbtunnel run --help): "
             + ", ".join(bad) + f"\n  known: {sorted(documented)}")
if not used:
    sys.exit("validate-deploy: no env vars found in the DaemonSet")
print(f"validate-deploy: env {', '.join(used)} known to the binary"
      + (f" (not in --help, checked by tests/deploy.rs: {' '.join(reserved)})" if reserved else ""))
PYEOF
