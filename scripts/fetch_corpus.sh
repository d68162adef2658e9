#!/usr/bin/env bash
# Fetch English prose from Debian packages and store it as xz-compressed plain text for
# scripts/train_demo.py (issue 7). Runs on the dev machine (it needs apt-get; the GPU machine
# has no network). Nothing is installed: `apt-get download` + `dpkg-deb -x` only.
#
#   scripts/fetch_corpus.sh [OUT_DIR]      # default OUT_DIR: .corpus in the repository root
#
# Output: OUT_DIR/*.txt.xz (a few tens of MiB in all; the script fails above MAX_MIB). The folder
# must stay out of git: add `/.corpus/` to .git/info/exclude, then name `.corpus` in the device
# tool's `carry` list (see docs/training.md).
set -euo pipefail

MAX_MIB=${MAX_MIB:-40}
PACKAGES=(python3.11-doc dict-gcide dict-foldoc dict-jargon fortunes fortunes-min)

root=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$root/.corpus}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$out" "$work/deb" "$work/x"
(cd "$work/deb" && apt-get download "${PACKAGES[@]}")
for f in "$work"/deb/*.deb; do dpkg-deb -x "$f" "$work/x"; done
x=$work/x

# Python docs: the reST sources Sphinx ships next to the HTML are cleaner text than the HTML.
find "$x/usr/share/doc/python3.11/html/_sources" -name '*.txt' -print0 | sort -z \
    | xargs -0 cat > "$work/python-docs.txt"
# dictd databases are dictzip files, which plain gzip reads.
for d in gcide foldoc jargon; do
    zcat "$x/usr/share/dictd/$d.dict.dz" > "$work/dict-$d.txt"
done
# fortune files: plain text with `%` lines between entries (skip the .dat indexes and .u8 links).
find "$x/usr/share/games/fortunes" -type f ! -name '*.dat' ! -name '*.u8' -print0 | sort -z \
    | xargs -0 cat > "$work/fortunes.txt"

rm -f "$out"/*.txt.xz
for t in "$work"/*.txt; do
    xz -9 -T0 -c "$t" > "$out/$(basename "$t").xz"
done
total=$(du -cb "$out"/*.txt.xz | tail -1 | cut -f1)
du -b "$work"/*.txt "$out"/*.txt.xz | sed "s|$work/||; s|$out/||"
echo "total compressed: $((total / 1048576)) MiB ($total bytes) in $out"
if (( total > MAX_MIB * 1048576 )); then
    echo "error: corpus is above MAX_MIB=$MAX_MIB MiB" >&2
    exit 1
fi
