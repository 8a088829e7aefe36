#!/usr/bin/env bash
# Installs everything cgpud needs on a Debian machine: system packages (with
# sudo when not root), then a virtualenv in .venv with cgpud and its test tools.
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBS=(fuse3 libfuse3-dev pkg-config gcc make python3-venv python3-dev runc busybox-static podman conmon prometheus systemd docker.io containerd
      debootstrap etcd-server containernetworking-plugins iproute2
      g++ libzstd1 liblz4-1  # nvcc's host compiler; what the stand-in driver reads compressed fat binaries with
      openssl  # what cgpu dra-webhook makes its certificate with
      qemu-user-static)  # runs the aarch64 builds of libcgpu in an arm64 root filesystem (tests/test_aarch64.py)
missing=()
for p in "${DEBS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv/python3-dev are only needed when the python3 in use is Debian's.
if ! python3 -c 'import sys; sys.exit(0 if sys.prefix.startswith("/usr") and not sys.prefix.startswith("/usr/local") else 1)'; then
  missing=("${missing[@]/python3-venv}"); missing=("${missing[@]/python3-dev}")
fi
# kubectl (the tests run `kubectl inspect cgpu` through it): Debian's kubernetes-client when none is installed
command -v kubectl >/dev/null || missing+=(kubernetes-client)
want=(); for p in "${missing[@]}"; do [ -n "$p" ] && want+=("$p"); done
if [ ${#want[@]} -gt 0 ]; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${want[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  echo "setup: installing Debian packages: ${want[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${want[@]}" >/dev/null
fi

# FUSE: let the daemon mount with allow_other when it is not run as root.
if [ -w /etc/fuse.conf ] && ! grep -qE '^\s*user_allow_other' /etc/fuse.conf; then
  echo user_allow_other >> /etc/fuse.conf
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.cgpud-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing cgpud into .venv (pyfuse3 compiles against libfuse3; this takes a minute the first time)"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[test]'
  touch "$stamp"
fi
# pytest-xdist: make test's two workers (tests/conftest.py, worker_group). Not in pyproject.toml's test
# extra: a change of that file rebuilds the image's dependency layers (the arm64 one under qemu: tens of minutes).
if ! .venv/bin/python -c "import xdist" 2>/dev/null; then
  .venv/bin/pip install -q "pytest-xdist>=3.6"
fi
# crictl (cri-tools), which tests/test_node_install.py drives containerd's CRI plugin with, as the
# kubelet does: built from the Go module proxy into .venv/bin (a few minutes the first time).
CRICTL_VERSION=v1.34.0
if [ ! -x .venv/bin/crictl ] || [ ! -f .venv/.crictl-$CRICTL_VERSION ]; then
  GO=$(command -v go || echo /usr/local/go/bin/go)
  [ -x "$GO" ] || { echo "setup: Go is needed to build crictl (sigs.k8s.io/cri-tools); install Go 1.23 or later" >&2; exit 1; }
  echo "setup: building crictl $CRICTL_VERSION (sigs.k8s.io/cri-tools, from the Go module proxy)"
  GOBIN="$PWD/.venv/bin" "$GO" install "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
  touch .venv/.crictl-$CRICTL_VERSION
fi
# The C parts (native/Makefile, one rule): the compiled OCI hook forwarder
# (docs/containers.md), built into .venv/bin. Hosts get them from
# scripts/install-service.sh.
make -s -C native BIN="$PWD/.venv/bin"

# The cluster tier's real Kubernetes components (tests/test_cluster.py, docs/cluster-tests.md):
# built from Kubernetes' own modules once per machine into /var/cache/cgpud/k8s; the first
# build takes 8 (quiet 2 cores) to 30 minutes (busy ones); later runs find them and return at once.
k8s_bin="$(nice -n 10 scripts/k8s-build.sh)"
echo "setup: Kubernetes components in $k8s_bin"
# containerd 2.x for the cluster tier's DRA tests (tests/test_cluster_dra.py): from its Go module,
# with the module and build caches above (about a minute the first time).
ctrd_bin="$(nice -n 10 scripts/containerd-build.sh)"
echo "setup: containerd 2 in $ctrd_bin"
# helm, for the chart's tests (tests/test_helm.py, deploy/helm/cgpud): from its Go module, cached the same way.
helm_bin="$(nice -n 10 scripts/helm-build.sh)"
echo "setup: helm in $helm_bin"
# An arm64 root filesystem with glibc 2.31 (Debian bullseye, debootstrap's first stage) that
# tests/test_aarch64.py runs libcgpu's aarch64 build in under qemu-aarch64-static: made once per
# machine into /var/cache/cgpud/rootfs (scripts/rootfs.sh; a minute or two the first time).
if [ "$(id -u)" -eq 0 ]; then arm64_root="$(nice -n 10 scripts/rootfs.sh bullseye minbase arm64)"
else arm64_root="$(sudo nice -n 10 scripts/rootfs.sh bullseye minbase arm64)"; fi
echo "setup: arm64 root filesystem in $arm64_root"
# qemu-user for aarch64 through binfmt_misc (the F flag: the interpreter opened now, so it runs in
# containers too), for the arm64 image's own steps (scripts/build-image.sh --arch amd64,arm64,
# tests/test_image.py): Debian's qemu-user-static ships the rule; without systemd nothing loads it.
binfmt() {
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
}
if [ "$(id -u)" -eq 0 ]; then binfmt; else sudo bash -c "$(declare -f binfmt); binfmt"; fi
echo "setup: qemu-aarch64 registered with binfmt_misc"
