#!/bin/bash
# Assembles a Docker build context in $DEST for lock requirements/$LOCK.txt: pdserve's sources
# (pyproject.toml, README.md, protos, connectors, engine, services, bench), the lock, and
# wheels/ holding exactly the lock's wheels (plus the extra pins given) for Linux x86_64 /
# CPython 3.11, so that `docker build` installs offline (`pip install --no-index`): a build
# reaches neither this machine's wheel folders nor, always, an index. pip's own configuration
# applies (local find-links and indexes first: torch's +cpu build is on no public index but
# PyTorch's). The wheels are kept in $CACHE, one folder per lock content, and hard-linked into the
# context: a second build downloads nothing.
#   tools/images/context.sh cpu build/images/cpu ~/.cache/pdserve/images setuptools==84.2.1 ...
set -euo pipefail
lock=requirements/$1.txt dest=$2 cache=$3
shift 3
[ -s "$lock" ] || { echo "lock file $lock missing: the dependency lock (requirements/*.txt) comes first" >&2; exit 1; }
key=$( (cat "$lock"; printf '%s\n' "$@") | sha256sum | cut -c1-16)
dir=$cache/wheels/$(basename "$lock" .txt)-$key
if [ ! -e "$dir/.complete" ]; then
  rm -rf "$cache/wheels/$(basename "$lock" .txt)"-*
  mkdir -p "$dir"
  # Every manylinux tag the image's glibc (bookworm's 2.36) runs.
  platforms=$(for n in $(seq 36 -1 17); do printf -- '--platform manylinux_2_%s_x86_64 ' "$n"; done
              echo --platform manylinux2014_x86_64 --platform linux_x86_64)
  # shellcheck disable=SC2086
  # The lock alone decides versions: a machine-wide pip constraint file does not apply.
  PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    $platforms -d "$dir" -r "$lock" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  touch "$dir/.complete"
fi
rm -rf "$dest"
mkdir -p "$dest/requirements"
cp -al "$dir" "$dest/wheels" 2>/dev/null || cp -a "$dir" "$dest/wheels"
rm -f "$dest/wheels/.complete"
cp "$lock" "$dest/requirements/"
tar -c --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md protos connectors engine services bench \
  | tar -x -C "$dest"
echo "context $dest: $(find "$dest/wheels" -name '*.whl' | wc -l) wheels ($(du -sh "$dest/wheels" | cut -f1)) for $lock"
