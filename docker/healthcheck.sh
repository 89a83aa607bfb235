#!/bin/sh
# The container's HEALTHCHECK: `pagoda health` (grpc.health.v1; exit 0 only when SERVING) on the port
# that docker/entrypoint.sh recorded in $PAGODA_PORT_FILE (default /tmp/pagoda-port), so it follows
# `docker run pagoda --port 6000` as well as PAGODA_PORT. Without a usable file it keeps the
# environment's PAGODA_PORT. PAGODA_TARGET, if set, still overrides both (pagoda health's own rule), and
# the TLS variables (PAGODA_TLS_CA, ...) apply as usual. Extra arguments go to `pagoda health`.
set -eu

port_file="${PAGODA_PORT_FILE:-/tmp/pagoda-port}"
if [ -r "$port_file" ]; then
  port="$(head -n 1 "$port_file")"
  case "$port" in
    '' | *[!0-9]*) ;;  # not a port number: pagoda serve refused it anyway
    *) export PAGODA_PORT="$port" ;;
  esac
fi
exec pagoda health --timeout 5 "$@"
