#!/usr/bin/env bash
# Builds containerd 2.x — containerd, containerd-shim-runc-v2 and ctr — from containerd's own
# released Go module (tests/containerd/go.mod pins the release), once per machine, for the cluster
# tier's DRA tests (tests/test_cluster_dra.py: containerd 2 with CDI, as the node runs it):
#
#   ${CGPUD_CONTAINERD_CACHE:-/var/cache/cgpud/containerd}/<release>-<hash>/bin/
#
# The module and build caches are the Kubernetes build's (scripts/k8s-build.sh: gomod/ and gocache/
# under ${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}), so the packages both use are compiled once. The
# build takes about a minute of two busy cores with those caches warm. Safe to run again and from
# several processes at once (a lock); prints the bin directory on stdout, progress on stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mod="$root/tests/containerd"
cache="${CGPUD_CONTAINERD_CACHE:-/var/cache/cgpud/containerd}"
k8s_cache="${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}"
release="$(awk '$1=="github.com/containerd/containerd/v2" {print $2; exit}' "$mod/go.mod")"
[ -n "$release" ] || { echo "containerd-build: no containerd/v2 release in $mod/go.mod" >&2; exit 1; }
tools=(containerd containerd-shim-runc-v2 ctr)
recipe=1  # raise when the build command below changes
hash="$( (cat "$mod/go.mod" "$mod/go.sum"; echo "$recipe ${tools[*]}") | sha256sum | cut -c1-12)"
out="$cache/$release-$hash"

have() { for t in "${tools[@]}"; do [ -x "$out/bin/$t" ] || return 1; done; }
! have || { echo "$out/bin"; exit 0; }
mkdir -p "$cache" "$k8s_cache"
exec 9>"$cache/.lock"
flock 9
! have || { echo "$out/bin"; exit 0; }

. "$root/scripts/go-find.sh"
GO="$(find_go "$mod/go.mod" "$k8s_cache")"
export GOMODCACHE="$k8s_cache/gomod" GOCACHE="$k8s_cache/gocache" GOFLAGS="-buildvcs=false -mod=readonly"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}" CGO_ENABLED=0
echo "containerd-build: building ${tools[*]} $release into $out/bin" >&2
start=$(date +%s)
tmp="$out.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp/bin"
cd "$mod"
pkgs=(); for t in "${tools[@]}"; do pkgs+=("github.com/containerd/containerd/v2/cmd/$t"); done
"$GO" build -trimpath -tags no_btrfs,no_devmapper,no_zfs \
  -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$release" -o "$tmp/bin/" "${pkgs[@]}"
echo "$(( $(date +%s) - start ))" > "$tmp/build-seconds"
rm -rf "$out"; mv "$tmp" "$out"
for old in "$cache"/v*-*; do [ "$old" = "$out" ] || [ ! -d "$old/bin" ] || rm -rf "$old"; done
echo "containerd-build: built in $(cat "$out/build-seconds") s" >&2
echo "$out/bin"
