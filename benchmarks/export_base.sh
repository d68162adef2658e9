#!/usr/bin/env bash
# The code of an earlier commit, for device.sh's BASE=DIR (a code change's before and after in
# one device call): ftchat (the demo model's weights included: ~40 MB of run's 64 MiB carry),
# benchmarks and pyproject.toml of REV, written to DIR (default .ab-base, which git ignores).
# From the repository root:
#
#   bash benchmarks/export_base.sh main .ab-base
#   run(command="BASE=$PWD/.ab-base ... bash benchmarks/device.sh offload48", carry=[".ab-base"])
set -eu
rev=${1:?usage: bash benchmarks/export_base.sh REV [DIR]} dir=${2:-.ab-base}
git rev-parse --verify --quiet "$rev^{commit}" > /dev/null || { echo "no commit $rev" >&2; exit 2; }
tmp=$(mktemp -d "${dir%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
git archive "$rev" ftchat benchmarks pyproject.toml | tar -x -C "$tmp"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir: $(git rev-parse --short "$rev") ($(du -sh "$dir" | cut -f1))"
