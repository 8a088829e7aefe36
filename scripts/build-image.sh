#!/usr/bin/env bash
# Builds the DaemonSet's image (deploy/kubernetes/Containerfile) with podman, offline but for
# Debian's and PyPI's package registries: the Containerfile's base, Debian 12 (bookworm), is made
# here by debootstrap (scripts/rootfs.sh) and imported under the base's name, so nothing is
# pulled from a container registry.
#   scripts/build-image.sh [TAG]     (default: cgpud:<version of cgpud>)
# Then push TAG where the nodes pull from and name it in deploy/kubernetes/kustomization.yaml
# (docs/kubernetes.md). Needs root (debootstrap) and podman.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' cgpud/__init__.py)
tag=${1:-cgpud:$version}
base=$(sed -n 's/^FROM //p' deploy/kubernetes/Containerfile | head -1)
if ! podman image exists "$base"; then
  rootfs=$(scripts/rootfs.sh bookworm)
  echo "build-image: importing $rootfs as $base"
  tar -C "$rootfs" --exclude=./.cgpud-done -c . | podman import - "$base" >/dev/null
fi
# pip in the build trusts what this host trusts (a proxy's CA in front of the registries, say).
trust=()
[ -f /etc/ssl/certs/ca-certificates.crt ] && \
  trust=(--volume /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro --build-arg PIP_CERT=/host-ca.crt)
podman build --pull=never --network=host "${trust[@]}" -f deploy/kubernetes/Containerfile -t "$tag" .
# a rebuild leaves the image it replaces untagged: remove those (ours only, by the label)
podman image prune -f --filter label=io.cgpud.image=daemonset >/dev/null || true
echo "build-image: built $tag"
