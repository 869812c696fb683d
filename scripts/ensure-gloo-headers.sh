#!/usr/bin/env bash
# Fetches gloo's headers for toma::dist's Gloo process group, once, into .deps/gloo (ignored).
#
# The PyPI torch wheel ships c10d's headers and gloo's compiled code (inside libtorch_cpu.so),
# but not gloo's own headers, which ProcessGroupGloo.hpp includes. Debian packages them
# (libgloo-dev, 49 kB, headers only are used: nothing of it is linked). Its snapshot is older than
# the gloo inside the wheel; toma only creates the group and calls allreduce through c10d's
# classes, whose layout does not depend on gloo's internals (tests/dist checks sums against a
# single process on every run). Without the headers, feature `dist` still builds, and the
# gradient all-reduce says it was built without Gloo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${TOMA_GLOO_DIR:-$root/.deps/gloo}"
deb="libgloo-dev_0.0~git20220518.5b14351-3_amd64.deb"
sha256="80529c9fd8af452faf489e686b94bf87075965c40673803810c4f41634b1e299"
url="http://deb.debian.org/debian/pool/main/g/gloo/$deb"

[ -f "$dest/include/gloo/algorithm.h" ] && exit 0
echo "toma: fetching gloo's headers (Debian $deb) into $dest" >&2
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if command -v curl >/dev/null; then
  curl -fsSL --retry 3 -o "$tmp/$deb" "$url"
else
  python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$tmp/$deb"
fi
echo "$sha256  $tmp/$deb" | sha256sum -c --quiet -
mkdir -p "$tmp/x"
if command -v dpkg-deb >/dev/null; then
  dpkg-deb -x "$tmp/$deb" "$tmp/x"
else
  (cd "$tmp" && ar x "$deb" && tar -xf data.tar.* -C x)
fi
mkdir -p "$dest"
rm -rf "$dest/include"
cp -r "$tmp/x/usr/include" "$dest/include"
