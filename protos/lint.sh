#!/usr/bin/env bash
# Lints protos/ with buf's STANDARD rules. buf comes from the npm registry (@bufbuild/buf):
#   npm ci --prefix tests/node
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
buf="$root/tests/node/node_modules/.bin/buf"
if [[ ! -x "$buf" ]]; then
  echo "protos/lint.sh: $buf not found; run: npm ci --prefix tests/node" >&2
  exit 2
fi
cd "$root/protos"
exec "$buf" lint
