#!/bin/bash
# Prints the base image to build on: $1 when it is present or can be pulled, else one built from
# Debian's packages (debootstrap --variant=minbase bookworm + python3, python3-venv; Python 3.11)
# and `docker import`ed as pdserve-base:bookworm. The root-filesystem tarball is cached in $2, so only
# the first build on a machine runs debootstrap (about a minute).
#   tools/images/base_image.sh pdserve-base:bookworm ~/.cache/pdserve/images
set -euo pipefail
image=$1
cache=$2
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$image" >/dev/null 2>&1; then echo "$image"; exit 0; fi
if [ "$image" != pdserve-base:bookworm ]; then
  if docker pull -q "$image" >/dev/null 2>&1; then echo "$image"; exit 0; fi
  echo "cannot pull $image: building on pdserve-base:bookworm (Debian's packages) instead" >&2
  if docker image inspect pdserve-base:bookworm >/dev/null 2>&1; then echo pdserve-base:bookworm; exit 0; fi
fi
tarball=$cache/base-bookworm.tar
if [ ! -s "$tarball" ]; then
  if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "debootstrap missing: apt-get install debootstrap" >&2; exit 1; }
    { apt-get install -y -q debootstrap || { apt-get update -q && apt-get install -y -q debootstrap; }; } >/dev/null
  fi
  mkdir -p "$cache"
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  # What a container never needs: apt's lists and caches, docs, man pages.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/*
  tar -C "$root" --numeric-owner -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  -c 'CMD ["/bin/bash"]' "$tarball" pdserve-base:bookworm >/dev/null
echo pdserve-base:bookworm
