#!/usr/bin/env bash
# Builds the DaemonSet's image (deploy/kubernetes/Containerfile) with podman, offline but for
# Debian's and PyPI's package registries: the Containerfile's base, Debian 12 (bookworm), is made
# here by debootstrap (scripts/rootfs.sh) and imported, so nothing is pulled from a container
# registry.
#   scripts/build-image.sh [TAG]                      this host's architecture: the image TAG
#   scripts/build-image.sh --arch amd64,arm64 [TAG]   one image per architecture, TAG-<arch>, and
#                                                     the manifest list TAG naming them all
#   scripts/build-image.sh --no-cache ...             every step run again (bench/image.py: a cold build)
# (default TAG: cgpud:<version of cgpud>). Nothing is compiled under emulation: the native programs
# are cross-built by zig on the host's own architecture, the Python dependencies come as the
# target's wheels and pyfuse3 is cross-compiled there too; another architecture than the host's
# runs only its image's apt step under qemu-user's binfmt (scripts/setup.sh registers
# qemu-aarch64), and the debootstrap second stage of its base. Then push TAG where the nodes pull from
# (`podman manifest push --all TAG docker://REGISTRY/cgpud:VERSION` for a list) and name it in
# deploy/kubernetes/kustomization.yaml (docs/kubernetes.md). Needs root (debootstrap) and podman.
set -euo pipefail
cd "$(dirname "$0")/.."
arches= options=()
usage="usage: build-image.sh [--arch ARCH[,ARCH...]] [--no-cache] [TAG]"
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arches=${2:?$usage}; shift 2;;
    --no-cache) options+=(--no-cache); shift;;
    -*) echo "$usage" >&2; exit 2;;
    *) break;;
  esac
done
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' cgpud/__init__.py)
tag=${1:-cgpud:$version}
host=$(dpkg --print-architecture)
# pip in the build trusts what this host trusts (a proxy's CA in front of the registries, say).
trust=()
[ -f /etc/ssl/certs/ca-certificates.crt ] && \
  trust=(--volume /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro --build-arg PIP_CERT=/host-ca.crt)

# The base for ARCH: Debian 12 of that architecture (scripts/rootfs.sh), imported as
# localhost/cgpud-base:bookworm-slim-ARCH with what Debian's own slim image leaves out left out:
# apt's package lists and caches (each stage runs apt-get update first), manuals, translations,
# documents but their copyrights, logs (of debootstrap's 204 MB, 85 MB are apt's lists and caches).
base_for() {
  local arch=$1 name=localhost/cgpud-base:bookworm-slim-$1 rootfs
  podman image exists "$name" && { echo "$name"; return; }
  if [ "$arch" = "$host" ]; then rootfs=$(scripts/rootfs.sh bookworm)
  else rootfs=$(scripts/rootfs.sh bookworm minbase "$arch" complete); fi
  echo "build-image: importing $rootfs as $name ($arch)" >&2
  (cd "$rootfs" && find . -mindepth 1 ! -type d \( -path './var/lib/apt/lists/*' -o -path './var/cache/apt/*' \
       -o -path './usr/share/man/*' -o -path './usr/share/info/*' -o -path './usr/share/locale/*' \
       -o -path './var/log/*' -o \( -path './usr/share/doc/*' ! -name copyright \) -o -name .cgpud-done \) \
       -o -print0 \
     | tar --null --no-recursion -T - -c) | podman import --arch "$arch" - "$name" >/dev/null
  echo "$name"
}

build() {  # ARCH TAG
  local base
  base=$(base_for "$1")
  # (the native stage runs on this host: its base is the host's; zig spawns a compiler per file at
  # once: the build's containers get this shell's limit on open files, not podman's default)
  podman build --pull=never --network=host --platform "linux/$1" "${trust[@]}" "${options[@]}" \
    --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" \
    --build-arg BASE="$base" --build-arg BUILD_BASE="$(base_for "$host")" --build-arg NATIVE_PLATFORM="linux/$host" \
    -f deploy/kubernetes/Containerfile -t "$2" .
}

if [ -z "$arches" ]; then
  build "$host" "$tag"
else
  images=()
  for arch in ${arches//,/ }; do
    build "$arch" "$tag-$arch"
    images+=("$tag-$arch")
  done
  podman manifest exists "$tag" 2>/dev/null && podman manifest rm "$tag" >/dev/null
  podman image exists "$tag" && podman rmi "$tag" >/dev/null
  podman manifest create "$tag" >/dev/null
  for image in "${images[@]}"; do
    podman manifest add "$tag" "containers-storage:localhost/${image#localhost/}" >/dev/null
  done
fi
# a rebuild leaves the image it replaces untagged: remove those (ours only, by the label)
podman image prune -f --filter label=io.cgpud.image=daemonset >/dev/null || true
echo "build-image: built $tag${arches:+ (a manifest list of $arches)}"
