#!/usr/bin/env bash
# Builds the real Kubernetes components of the cluster test tier (tests/test_cluster.py) —
# kube-apiserver, kube-scheduler, kubelet, kubectl and kube-controller-manager — from Kubernetes' own released Go
# modules (tests/cluster/go.mod pins the release), once per machine, into a cache:
#
#   ${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}/
#       gomod/   GOMODCACHE (the downloaded modules)
#       gocache/ GOCACHE (compiled packages: a second build of the same release links only)
#       <release>-<hash>/bin/   the binaries; <hash> covers go.mod, go.sum and this script
#
# K8S_VERSION=1.36.3 builds that release instead, from tests/cluster/versions/v1.36.3/go.mod (written by
# scripts/k8s-gomod.sh and committed), into its own <release>-<hash> beside the default's: each release
# built is kept (the default's and any other), so the tier can run on several in turn.
#
# Safe to run again and from several processes at once (a lock): when the binaries of this
# go.mod are there it does nothing (CGPUD_K8S_FORCE=1 builds them again: bench/cluster.py's warm
# figure). <bin>/../build-seconds says how long their build took and whether the cache was cold. Prints the bin directory on stdout, progress on stderr.
# Go: >= the go line of tests/cluster/go.mod, on PATH or in /usr/local/go, else the toolchain module
# from the Go module proxy (kept in the cache).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/cluster"
if [ -n "${K8S_VERSION:-}" ] && [ "v${K8S_VERSION#v}" != "$(awk '$1=="k8s.io/kubernetes" {print $2; exit}' "$mod/go.mod")" ]; then
  mod="$root/tests/cluster/versions/v${K8S_VERSION#v}"
  [ -f "$mod/go.mod" ] || { echo "k8s-build: no module for Kubernetes ${K8S_VERSION#v}: run scripts/k8s-gomod.sh ${K8S_VERSION#v} first (releases here: $(ls "$root/tests/cluster/versions" 2>/dev/null | tr '\n' ' '))" >&2; exit 1; }
fi
cache="${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}"
release="$(awk '$1=="k8s.io/kubernetes" || ($1=="require" && $2=="k8s.io/kubernetes") {print ($1=="require" ? $3 : $2); exit}' "$mod/go.mod")"
[ -n "$release" ] || { echo "k8s-build: no k8s.io/kubernetes release in $mod/go.mod" >&2; exit 1; }
tools=(kube-apiserver kube-scheduler kubelet kubectl kube-controller-manager)
recipe=1  # raise when the build command below changes: binaries built otherwise are then built again
hash="$( (cat "$mod/go.mod" "$mod/go.sum"; echo "$recipe ${tools[*]}") | sha256sum | cut -c1-12)"
out="$cache/$release-$hash"

have() { for t in "${tools[@]}"; do [ -x "$out/bin/$t" ] || return 1; done; }
[ -n "${CGPUD_K8S_FORCE:-}" ] || ! have || { echo "$out/bin"; exit 0; }   # CGPUD_K8S_FORCE=1: build again

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
[ -n "${CGPUD_K8S_FORCE:-}" ] || ! have || { echo "$out/bin"; exit 0; }   # built by another while we waited

# Go: >= go.mod's go line (scripts/go-find.sh: on PATH, /usr/local/go, else the toolchain module)
. "$root/scripts/go-find.sh"
GO="$(find_go "$mod/go.mod" "$cache")"

export GOMODCACHE="$cache/gomod" GOCACHE="$cache/gocache" GOFLAGS="-buildvcs=false -mod=readonly"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0
# The release's own version stamp (hack/lib/version.sh sets these): without it the
# components call themselves v0.0.0-master and version checks between them misfire.
major="${release#v}"; major="${major%%.*}"; minor="${release#v*.}"; minor="${minor%%.*}"
ldflags="-s -w"
for kv in gitVersion="$release" gitMajor="$major" gitMinor="$minor" gitTreeState=clean buildDate=1970-01-01T00:00:00Z; do
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do ldflags+=" -X $pkg.$kv"; done
done
echo "k8s-build: building ${tools[*]} $release into $out/bin (GOMODCACHE/GOCACHE under $cache; the first build takes long)" >&2
start=$(date +%s)
kind=warm; [ -n "$(ls -A "$GOCACHE" 2>/dev/null)" ] || kind=cold   # (of the build cache)
tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
cd "$mod"
pkgs=(); for t in "${tools[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$t"); done
"$GO" build -trimpath -ldflags "$ldflags" -o "$tmp/bin/" "${pkgs[@]}"
took=$(( $(date +%s) - start ))
echo "$took $kind" > "$tmp/build-seconds"
# (a forced build keeps the first build's figure: bench/cluster.py reports it as the first build)
[ -z "${CGPUD_K8S_FORCE:-}" ] || [ ! -f "$out/build-seconds" ] || cp "$out/build-seconds" "$tmp/build-seconds"
rm -rf "$out"; mv "$tmp" "$out"
for old in "$cache/$release"-*; do   # this release's binaries of an earlier go.mod or recipe (half a GB each)
  [ "$old" = "$out" ] || [ ! -d "$old/bin" ] || rm -rf "$old"
done
echo "k8s-build: built in $took s ($kind build cache)" >&2
echo "$out/bin"
