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

# What follows runs side by side (issue 48: a fresh machine's set-up took 27 minutes one step after
# another): the Python environment (mostly downloads: NVIDIA's wheels), the Go builds (CPU: Kubernetes,
# then containerd, whose build reuses the packages Kubernetes' compiled into the same caches; helm, of
# caches of its own) and the root filesystems (downloads, and for the arm64 image's base debootstrap's
# second stage under qemu). Each job's output goes to a log of its own, printed when it fails; each
# prints how long it took. Go's module and build caches are safe for go commands running at once (the
# module cache locks each download since Go 1.11, golang/go#26794; build-cache entries are written
# whole and renamed into place), and each build script holds its own lock.
logs=$(mktemp -d "${TMPDIR:-/tmp}/cgpud-setup.XXXXXX")
trap 'rm -rf "$logs"' EXIT
jobs_started=()
started=$(date +%s)
bg() {  # NAME COMMAND...: COMMAND in the background, its stdout in $logs/NAME.out, its stderr in $logs/NAME.err
  local name=$1; shift
  # (the inner subshell is not in a condition: `set -e` stops it at its first failing command)
  ( s=$(date +%s); set +e; ( set -e; "$@" ) >"$logs/$name.out" 2>"$logs/$name.err"; rc=$?
    echo "$rc $(( $(date +%s) - s ))" >"$logs/$name.rc"; exit "$rc" ) &
  jobs_started+=("$name:$!")
}
sudo_() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

PY=${PYTHON:-python3}
python_env() {
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PY" -m venv .venv
  fi
  local stamp=.venv/.cgpud-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing cgpud into .venv (pyfuse3 compiles against libfuse3; this takes a minute the first time)"
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -e '.[test]'
    touch "$stamp"
  fi
  # pytest-xdist: make test's two workers (tests/conftest.py, worker_group). Not in pyproject.toml's test
  # extra: a change of that file rebuilds the image's dependency layers.
  if ! .venv/bin/python -c "import xdist" 2>/dev/null; then
    .venv/bin/pip install -q "pytest-xdist>=3.6"
  fi
  # crictl (cri-tools), which tests/test_node_install.py drives containerd's CRI plugin with, as the
  # kubelet does: built from the Go module proxy into .venv/bin (a few minutes the first time).
  local CRICTL_VERSION=v1.34.0 GO
  if [ ! -x .venv/bin/crictl ] || [ ! -f .venv/.crictl-$CRICTL_VERSION ]; then
    GO=$(command -v go || echo /usr/local/go/bin/go)
    [ -x "$GO" ] || { echo "setup: Go is needed to build crictl (sigs.k8s.io/cri-tools); install Go 1.23 or later" >&2; return 1; }
    echo "setup: building crictl $CRICTL_VERSION (sigs.k8s.io/cri-tools, from the Go module proxy)"
    GOBIN="$PWD/.venv/bin" "$GO" install "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
    touch .venv/.crictl-$CRICTL_VERSION
  fi
  # The C parts (native/Makefile, one rule): the compiled OCI hook forwarder
  # (docs/containers.md), built into .venv/bin. Hosts get them from
  # scripts/install-service.sh.
  make -s -C native BIN="$PWD/.venv/bin"
}
bg python python_env

# The cluster tier's real Kubernetes components (tests/test_cluster.py, docs/cluster-tests.md):
# built from Kubernetes' own modules once per machine into /var/cache/cgpud/k8s; the first
# build takes 8 (quiet 2 cores) to 30 minutes (busy ones); later runs find them and return at once.
# Then containerd 2.x for the cluster tier's DRA tests (tests/test_cluster_dra.py): from its Go module,
# with the module and build caches above (about a minute the first time, after Kubernetes').
go_builds() {
  local k8s_bin ctrd_bin
  k8s_bin="$(nice -n 10 scripts/k8s-build.sh)"
  echo "setup: Kubernetes components in $k8s_bin"
  ctrd_bin="$(nice -n 10 scripts/containerd-build.sh)"
  echo "setup: containerd 2 in $ctrd_bin"
}
bg kubernetes go_builds
# helm, for the chart's tests (tests/test_helm.py, deploy/helm/cgpud): from its Go module, caches of its own.
helm_build() { local bin; bin="$(nice -n 10 scripts/helm-build.sh)"; echo "setup: helm in $bin"; }
bg helm helm_build

# qemu-user for aarch64 through binfmt_misc (the F flag: the interpreter opened now, so it runs in
# containers too), for the arm64 image's apt step and its base's second stage (scripts/build-image.sh
# --arch amd64,arm64, tests/test_image.py): Debian's qemu-user-static ships the rule; without systemd
# nothing loads it.
binfmt() {
  [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register
}
if [ "$(id -u)" -eq 0 ]; then binfmt; else sudo bash -c "$(declare -f binfmt); binfmt"; fi
echo "setup: qemu-aarch64 registered with binfmt_misc"
# The root filesystems (scripts/rootfs.sh; made once per machine into /var/cache/cgpud/rootfs, a minute
# or two each the first time): an arm64 one with glibc 2.31 (Debian bullseye, debootstrap's first
# stage) that tests/test_aarch64.py runs libcgpu's aarch64 build in under qemu-aarch64-static; and the
# image's bases, Debian 12 for this host and for arm64 (scripts/build-image.sh, tests/test_image.py).
root_filesystems() {
  local dir
  for spec in "bullseye minbase arm64" "bookworm minbase" "bookworm minbase arm64 complete"; do
    # shellcheck disable=SC2086
    dir="$(sudo_ nice -n 10 scripts/rootfs.sh $spec)"
    echo "setup: $spec root filesystem in $dir"
  done
}
bg rootfs root_filesystems

failed=()
for job in "${jobs_started[@]}"; do
  name=${job%%:*}
  wait "${job#*:}" || true
  read -r rc took < "$logs/$name.rc" || { rc=1; took=?; }
  cat "$logs/$name.out"
  if [ "$rc" -eq 0 ]; then
    echo "setup: $name done in $took s"
  else
    echo "setup: $name FAILED (exit $rc, after $took s); its errors:" >&2
    tail -20 "$logs/$name.err" >&2
    failed+=("$name")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "setup: failed: ${failed[*]}" >&2; exit 1; }
echo "setup: ready in $(( $(date +%s) - started )) s after the Debian packages"
