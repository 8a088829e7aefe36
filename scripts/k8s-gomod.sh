#!/usr/bin/env bash
# Writes the Go module that pins another Kubernetes release for the cluster tier:
#
#   scripts/k8s-gomod.sh 1.36.3     -> tests/cluster/versions/v1.36.3/{go.mod,go.sum}
#
# As tests/cluster/go.mod does for the default release: require k8s.io/kubernetes at that release, point
# each staging module it names at v0.0.0 (its go.mod's `replace k8s.io/x => ./staging/src/k8s.io/x`) to the
# published k8s.io/x v0.<minor>.<patch>, name the five components as tools, and let `go mod tidy` fill
# in the rest from the Go module proxy. Run once per release by a developer; the result is committed,
# so scripts/k8s-build.sh (K8S_VERSION=1.36.3) builds from a fixed go.sum. Nothing here is our code.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
ver="${1:?usage: k8s-gomod.sh MAJOR.MINOR.PATCH (a release of k8s.io/kubernetes)}"
ver="${ver#v}"
[[ "$ver" =~ ^1\.([0-9]+)\.([0-9]+)$ ]] || { echo "k8s-gomod: $ver is not a release like 1.36.3" >&2; exit 1; }
staging_ver="v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}"
cache="${CGPUD_K8S_CACHE:-/var/cache/cgpud/k8s}"
out="$root/tests/cluster/versions/v$ver"
. "$root/scripts/go-find.sh"
GO="$(find_go "$root/tests/cluster/go.mod" "$cache")"
export GOMODCACHE="$cache/gomod" GOCACHE="$cache/gocache" GOFLAGS="-mod=mod" GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
kmod="$("$GO" mod download -json "k8s.io/kubernetes@v$ver" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')"
[ -f "$kmod" ] || { echo "k8s-gomod: the Go module proxy has no k8s.io/kubernetes v$ver" >&2; exit 1; }
mapfile -t staging < <(sed -n 's|^\s*\(k8s\.io/[a-z0-9./-]*\) => \./staging/src/.*|\1|p' "$kmod")
[ "${#staging[@]}" -gt 10 ] || { echo "k8s-gomod: no staging modules found in $kmod" >&2; exit 1; }
mkdir -p "$out"
{
  cat <<EOF
// The cluster tier's Kubernetes at v$ver (scripts/k8s-gomod.sh wrote it; K8S_VERSION=$ver make
// test-cluster builds and runs it): k8s.io/kubernetes at that release, each staging module it
// requires at v0.0.0 pointed at the matching published release. Nothing here is our code.
module cgpud.test/cluster

go 1.26.0

godebug default=go1.26

tool (
	k8s.io/kubernetes/cmd/kube-apiserver
	k8s.io/kubernetes/cmd/kube-controller-manager
	k8s.io/kubernetes/cmd/kube-scheduler
	k8s.io/kubernetes/cmd/kubectl
	k8s.io/kubernetes/cmd/kubelet
)

require k8s.io/kubernetes v$ver

replace (
EOF
  for m in "${staging[@]}"; do printf '\t%s v0.0.0 => %s %s\n' "$m" "$m" "$staging_ver"; done
  echo ")"
} > "$out/go.mod"
rm -f "$out/go.sum"
# A release whose staging modules the proxy does not all serve (k8s.io/endpointslice v0.32.13 is refused)
# leaves nothing behind: its directory is removed with one line saying which release to try instead.
(cd "$out" && "$GO" mod tidy >&2) || { rm -rf "$out"; echo "k8s-gomod: go mod tidy failed for v$ver (above: a module the proxy does not serve?); try another patch release" >&2; exit 1; }
echo "$out"
