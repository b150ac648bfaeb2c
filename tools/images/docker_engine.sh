#!/bin/bash
# Makes sure a Docker engine answers: when none does and dockerd is installed (Debian's docker.io),
# starts one in the background (root only), with its pid file and log under /var/run and
# /var/log, and waits until it serves. The engine keeps running after the build or test.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
command -v dockerd >/dev/null || { echo "no Docker engine answers and dockerd is missing: apt-get install docker.io" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "no Docker engine answers; starting dockerd needs root" >&2; exit 1; }
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
