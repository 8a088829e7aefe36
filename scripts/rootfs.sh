#!/usr/bin/env bash
# A Debian root filesystem made by debootstrap, kept in a cache that the tests and the
# image builds share: scripts/rootfs.sh SUITE [VARIANT [ARCH]]  ->  prints its directory.
#
#   scripts/rootfs.sh bullseye   # glibc 2.31: an older-glibc image (libcgpu must run in it)
#   scripts/rootfs.sh bookworm   # the release deploy/kubernetes/Containerfile builds on
#   scripts/rootfs.sh bullseye minbase arm64   # an arm64 image with glibc 2.31, for qemu-aarch64
#   scripts/rootfs.sh bookworm minbase arm64 complete   # ... with debootstrap's second stage run
#                                              # under qemu-user's binfmt: a whole system (the arm64
#                                              # image's base, scripts/build-image.sh)
#
# Another architecture than the host's (ARCH, Debian's name) is debootstrap's first stage only
# (--foreign: the packages unpacked, their scripts not run, as nothing of that architecture can
# run here without binfmt_misc): what `qemu-aarch64-static -L DIR` needs of the image, its
# dynamic loader and C library (tests/test_aarch64.py).
#
# CGPUD_ROOTFS_CACHE (default /var/cache/cgpud/rootfs) holds one directory per suite and
# variant; a finished one has a .cgpud-done stamp and is reused; a half-made one (an
# interrupted run) is made again. Needs root and Debian's debootstrap (scripts/setup.sh
# installs it). The first run of a suite takes a few minutes (it downloads ~40 MB).
set -euo pipefail
suite=${1:?usage: rootfs.sh SUITE [VARIANT]}
variant=${2:-minbase}
arch=${3:-}
complete=${4:-}
cache=${CGPUD_ROOTFS_CACHE:-/var/cache/cgpud/rootfs}
dir="$cache/$suite-$variant"
foreign=()
if [ -n "$arch" ] && [ "$arch" != "$(dpkg --print-architecture)" ]; then
  dir="$dir-$arch"
  foreign=(--arch="$arch" --foreign)
  [ "$complete" = complete ] && dir="$dir-complete"
fi
if [ -f "$dir/.cgpud-done" ]; then
  echo "$dir"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "rootfs: debootstrap is not installed (scripts/setup.sh installs it)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "rootfs: debootstrap needs root" >&2; exit 1; }
mkdir -p "$cache"
# One maker at a time per suite (the tests of two sessions may ask at once).
exec 9>"$cache/.${dir##*/}.lock"
flock 9
if [ ! -f "$dir/.cgpud-done" ]; then
  rm -rf "$dir.tmp"
  mirror=${CGPUD_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*debian\/*\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
  debootstrap "${foreign[@]}" --variant="$variant" "$suite" "$dir.tmp" ${mirror:+"$mirror"} >"$dir.log" 2>&1 \
    || { echo "rootfs: debootstrap $suite ${arch:-} failed; its log: $dir.log" >&2; tail -5 "$dir.log" >&2; exit 1; }
  if [ "${#foreign[@]}" -gt 0 ] && [ "$complete" = complete ]; then
    chroot "$dir.tmp" /bin/true 2>/dev/null || { echo "rootfs: $arch programs do not run here: the second stage needs qemu-user's binfmt for $arch (scripts/setup.sh registers qemu-aarch64)" >&2; exit 1; }
    chroot "$dir.tmp" /debootstrap/debootstrap --second-stage >>"$dir.log" 2>&1 \
      || { echo "rootfs: debootstrap's second stage for $suite $arch failed; its log: $dir.log" >&2; tail -5 "$dir.log" >&2; exit 1; }
  fi
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
  touch "$dir/.cgpud-done"
fi
echo "$dir"
