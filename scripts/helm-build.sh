#!/usr/bin/env bash
# Builds the real `helm` (helm.sh/helm/v3's cmd/helm, the release scripts/helm/go.mod pins) from its
# Go module, once per machine, into a cache, for the chart's tests (tests/test_helm.py):
#
#   ${CGPUD_HELM_CACHE:-/var/cache/cgpud/helm}/
#       gomod/ gocache/        the module and build caches
#       <release>-<hash>/bin/helm
#
# Safe to run again and from several processes at once (a lock): when the binary of this go.mod is
# there it does nothing. Prints the bin directory on stdout, progress on stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/scripts/helm"
cache="${CGPUD_HELM_CACHE:-/var/cache/cgpud/helm}"
release="$(awk '$1=="helm.sh/helm/v3" || ($1=="require" && $2=="helm.sh/helm/v3") {print ($1=="require" ? $3 : $2); exit}' "$mod/go.mod")"
[ -n "$release" ] || { echo "helm-build: no helm.sh/helm/v3 release in $mod/go.mod" >&2; exit 1; }
recipe=1
hash="$( (cat "$mod/go.mod" "$mod/go.sum"; echo "$recipe") | sha256sum | cut -c1-12)"
out="$cache/$release-$hash"
[ -x "$out/bin/helm" ] && { echo "$out/bin"; exit 0; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
[ -x "$out/bin/helm" ] && { echo "$out/bin"; exit 0; }
. "$root/scripts/go-find.sh"
GO="$(find_go "$mod/go.mod" "$cache")"
export GOMODCACHE="$cache/gomod" GOCACHE="$cache/gocache" GOFLAGS="-buildvcs=false -mod=readonly"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0
echo "helm-build: building helm $release into $out/bin (a few minutes the first time)" >&2
tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
cd "$mod"
"$GO" build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$release" -o "$tmp/bin/helm" \
    helm.sh/helm/v3/cmd/helm
rm -rf "$out"; mv "$tmp" "$out"
echo "$out/bin"
