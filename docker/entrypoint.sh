#!/bin/sh
# The container's ENTRYPOINT: `pagoda serve "$@"`, after recording the port the server will listen on
# for the HEALTHCHECK (docker/healthcheck.sh).
#
# Why: the HEALTHCHECK runs in a fresh process with the image's / `docker run -e` environment, not
# this process's, so `docker run pagoda --port 6000` would leave it asking PAGODA_PORT's 50051. The
# port is resolved here as `pagoda serve` resolves it (the last --port N / --port=N flag, argparse's
# unique abbreviations --po / --por included, none after `--`; else PAGODA_PORT; else 50051), exported
# as PAGODA_PORT (the flag still wins in pagoda serve; the two agree) and written to $PAGODA_PORT_FILE
# (default /tmp/pagoda-port), which the HEALTHCHECK reads. The file is rewritten on every start, so a
# restarted container cannot keep a stale one. `exec` makes pagoda PID 1 (or tini's child with
# `docker run --init`), so SIGTERM from `docker stop` reaches it and starts the drain.
#
# Limits: with --port 0 (any free port) the port is only known after binding, so the HEALTHCHECK cannot
# follow it: give a fixed port in a container. If the file cannot be written (a --read-only root file
# system without a tmpfs on /tmp), a warning is printed and the HEALTHCHECK falls back to PAGODA_PORT.
set -eu

port_file="${PAGODA_PORT_FILE:-/tmp/pagoda-port}"
port="${PAGODA_PORT:-50051}"
want_value=0
for arg in "$@"; do
  if [ "$want_value" = 1 ]; then
    port="$arg"
    want_value=0
    continue
  fi
  case "$arg" in
    --) break ;;
    --po=* | --por=* | --port=*) port="${arg#*=}" ;;
    --po | --por | --port) want_value=1 ;;
  esac
done

export PAGODA_PORT="$port"
if ! printf '%s\n' "$port" > "$port_file" 2>/dev/null; then
  echo "pagoda-entrypoint: warning: cannot write $port_file; the HEALTHCHECK will use PAGODA_PORT from the container's environment" >&2
fi
exec pagoda serve "$@"
