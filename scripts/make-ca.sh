#!/usr/bin/env bash
# Makes a development root for a cluster: DIR/ca-cert.pem and DIR/ca-key.pem (ECDSA P-256, key
# in PKCS#8, 10 years), the two files mbtunnel loads from its ca_dir. Every node proxy must use the
# same root, so it goes into a Secret (README, "Deploying on Kubernetes"):
#   scripts/make-ca.sh ca && kubectl -n mbtunnel-system create secret generic mbtunnel-ca \
#     --from-file=ca/ca-cert.pem --from-file=ca/ca-key.pem
# Refuses to overwrite an existing root. Needs openssl.
set -euo pipefail
DIR=${1:?usage: scripts/make-ca.sh DIR [TRUST_DOMAIN]}
TD=${2:-cluster.local}
if [ -e "$DIR/ca-cert.pem" ] || [ -e "$DIR/ca-key.pem" ]; then
  echo "make-ca: $DIR already holds a root; not overwriting" >&2; exit 1
fi
mkdir -p "$DIR"
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
  -subj "/O=$TD/CN=mbtunnel development root" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
  -keyout "$DIR/ca-key.pem" -out "$DIR/ca-cert.pem" 2>/dev/null
chmod 644 "$DIR/ca-cert.pem"
echo "make-ca: wrote $DIR/ca-cert.pem and $DIR/ca-key.pem"
