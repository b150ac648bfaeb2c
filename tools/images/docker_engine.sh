#!/bin/bash
# Makes sure a Docker engine answers: when none does, starts Debian's dockerd (package docker.io,
# installed here when missing) in the background (root only), with its pid file and log under
# /var/run and /var/log, and waits until it serves. The engine keeps running after the build or
# test.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
[ "$(id -u)" = 0 ] || { echo "no Docker engine answers; starting dockerd needs root" >&2; exit 1; }
if ! command -v dockerd >/dev/null; then
  echo "installing Debian's docker.io" >&2
  { apt-get install -y -q docker.io || { apt-get update -q && apt-get install -y -q docker.io; }; } >/dev/null
fi
log=/var/log/pdserve-dockerd.log
echo "starting dockerd (log $log)" >&2
setsid dockerd --pidfile /var/run/pdserve-dockerd.pid >"$log" 2>&1 </dev/null &
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then exit 0; fi
  sleep 0.5
done
echo "dockerd did not start within 30 s; the end of $log:" >&2
tail -20 "$log" >&2
exit 1
