#!/usr/bin/env bash
# Builds the real Kubernetes components of the cluster test tier (tests/test_cluster.py) —
# kube-apiserver, kube-scheduler, kubelet and kubectl — from Kubernetes' own released Go
# modules (tests/cluster/go.mod pins the release), once per machine, into a cache:
#
#   ${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}/
#       gomod/   GOMODCACHE (the downloaded modules)
#       gocache/ GOCACHE (compiled packages: a second build of the same release links only)
#       <release>-<hash>/bin/   the binaries; <hash> covers go.mod, go.sum and this script
#
# Safe to run again and from several processes at once (a lock): when the binaries of this
# go.mod are there it does nothing. Prints the bin directory on stdout, progress on stderr.
# Needs Go >= 1.26 on PATH or in /usr/local/go (tests/cluster/go.mod says which).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/cluster"
cache="${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}"
release="$(awk '$1=="k8s.io/kubernetes" || ($1=="require" && $2=="k8s.io/kubernetes") {print ($1=="require" ? $3 : $2); exit}' "$mod/go.mod")"
[ -n "$release" ] || { echo "k8s-build: no k8s.io/kubernetes release in $mod/go.mod" >&2; exit 1; }
hash="$(cat "$mod/go.mod" "$mod/go.sum" "$0" | sha256sum | cut -c1-12)"
out="$cache/$release-$hash"
tools=(kube-apiserver kube-scheduler kubelet kubectl)

have() { for t in "${tools[@]}"; do [ -x "$out/bin/$t" ] || return 1; done; }
if have; then echo "$out/bin"; exit 0; fi

GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
[ -x "$GO" ] || { echo "k8s-build: Go not found (install Go >= 1.26, or set GO=/path/to/go)" >&2; exit 1; }

mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if have; then echo "$out/bin"; exit 0; fi   # built by another process while we waited

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
tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
cd "$mod"
pkgs=(); for t in "${tools[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$t"); done
"$GO" build -trimpath -ldflags "$ldflags" -o "$tmp/bin/" "${pkgs[@]}"
rm -rf "$out"; mv "$tmp" "$out"
echo "k8s-build: built in $(( $(date +%s) - start )) s" >&2
echo "$out/bin"
