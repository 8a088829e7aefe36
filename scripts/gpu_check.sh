#!/bin/sh
# make gpu-check BUNDLE=gpu-bundle: the real-GPU check (scripts/gpu_check.py) on a GPU machine that has no
# network and lacks what cgpud needs: everything comes from a bundle built elsewhere by `make gpu-bundle`
# (scripts/gpu_bundle.sh). Nothing is installed on the machine itself: the bundle's wheels go into
# BUNDLE/site with pip --no-index --no-deps (the machine's pip, else pip's own wheel from the bundle), and
# the check runs with BUNDLE/site on PYTHONPATH, the native programs from BUNDLE/bin and libcgpu.so from
# BUNDLE/lib. No scripts/setup.sh, no apt. docs/isolation.md, "Running the real-GPU check".
#
#   scripts/gpu_check.sh BUNDLE [gpu_check.py options: --only, --out FILE, --quick, --keep, --gpus]
#   PYTHON=<python3 with PyTorch and the like> (default python3)
set -eu
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/gpu_check.sh BUNDLE [gpu_check.py options]" >&2; exit 2; }
BUNDLE=$1; shift
PY=${PYTHON:-python3}
[ -d "$BUNDLE/wheels" ] && [ -f "$BUNDLE/lib/libcgpu.so" ] \
  || { echo "gpu-check: $BUNDLE is not a bundle (make gpu-bundle builds one)" >&2; exit 2; }
bundle=$(cd "$BUNDLE" && pwd)
if [ "$(cat "$bundle/SOURCE" 2>/dev/null)" != "$(bash scripts/gpu_bundle.sh --source-hash)" ]; then
  echo "gpu-check: warning: $BUNDLE was built from other sources than this tree's (make gpu-bundle again); going on" >&2
fi
site=$bundle/site
rm -rf "$site"
pipwhl=  # (empty: the machine's own pip)
"$PY" -m pip --version >/dev/null 2>&1 || pipwhl="$(ls "$bundle"/pip/pip-*.whl | head -1)/pip"  # (pip runs from its wheel)
pip() { if [ -n "$pipwhl" ]; then "$PY" "$pipwhl" "$@"; else "$PY" -m pip "$@"; fi; }
pip install -q --disable-pip-version-check --no-warn-script-location --no-index --no-deps --target "$site" \
    "$bundle"/wheels/*.whl >&2 \
  && "$PY" -c "import sys; sys.path.insert(0, sys.argv[1]); import pyfuse3, trio, tomlkit, cgpud" "$site" \
  || { echo "gpu-check: the bundle's wheels did not install into $site for $PY" >&2; exit 2; }
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
PATH=$site/bin:$bundle/bin:$PATH
CGPUD_NATIVE=$bundle/bin/libcgpu-switch.so
export PYTHONPATH PATH CGPUD_NATIVE
exec "$PY" scripts/gpu_check.py --libcgpu "$bundle/lib/libcgpu.so" "$@"
