#!/usr/bin/env bash
# Installs cgpud as a systemd service (docs/service.md):
#   - cgpud into its own virtualenv ($VENV, default /opt/cgpud), or link an
#     existing one with CGPUD_BIN=/path/to/venv/bin (no build);
#   - /usr/local/bin/{cgpud,cgpu,cgpu-smi} -> that venv (the unit and the
#     hooks.d file name these paths);
#   - /etc/systemd/system/cgpud.service, /etc/default/cgpud (kept if present);
#   - /usr/local/libexec/cgpu-hook, the compiled OCI hook (native/hook/cgpu-hook.c, make -C native)
#     and /etc/containers/oci/hooks.d/cgpu-hook.json naming it (podman, CRI-O); beside it
#     libcgpu-switch.so, the daemon's native part of the compute gate (native/switch);
#   - /usr/local/lib/cgpu/libcgpu.so, the in-container library (native/libcgpu; the daemon's --libcgpu);
#   - /usr/local/bin/cgpu-runtime, the OCI runtime wrapper (native/runtime), and, where Docker or
#     containerd is installed, their settings naming it (`cgpu runtime-config`; --no-runtimes: not);
#   - then daemon-reload and `systemctl enable --now cgpud` (skip: --no-start).
# DESTDIR=/some/root stages everything below that directory instead (no systemctl).
# Run from the source checkout, as root. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

START=1
RUNTIMES=1
for arg in "$@"; do
  case "$arg" in
    --no-start) START=0 ;;
    --no-runtimes) RUNTIMES=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install-service: unknown option $arg (known: --no-start, --no-runtimes)" >&2; exit 2 ;;
  esac
done
DESTDIR=${DESTDIR:-}
VENV=${VENV:-/opt/cgpud}
if [ -z "$DESTDIR" ] && [ "$(id -u)" -ne 0 ]; then
  echo "install-service: run as root (it writes /etc/systemd/system and /usr/local/bin)" >&2
  exit 1
fi

if [ -n "${CGPUD_BIN:-}" ]; then
  BIN=$(cd "$CGPUD_BIN" && pwd)
else
  BIN="$VENV/bin"
  if [ ! -x "$DESTDIR$BIN/python" ]; then
    echo "install-service: creating $DESTDIR$VENV"
    "${PYTHON:-python3}" -m venv "$DESTDIR$VENV"
  fi
  echo "install-service: installing cgpud into $DESTDIR$VENV (pyfuse3 compiles against libfuse3)"
  "$DESTDIR$BIN/pip" install -q --upgrade pip >/dev/null
  "$DESTDIR$BIN/pip" install -q .
fi
for tool in cgpud cgpu cgpu-smi; do
  [ -x "$DESTDIR$BIN/$tool" ] || [ -x "$BIN/$tool" ] || { echo "install-service: $BIN/$tool is missing" >&2; exit 1; }
done

install -d "$DESTDIR/usr/local/bin" "$DESTDIR/usr/local/libexec" "$DESTDIR/etc/systemd/system" "$DESTDIR/etc/default" \
  "$DESTDIR/etc/containers/oci/hooks.d"
for tool in cgpud cgpu cgpu-smi; do
  ln -sfn "$BIN/$tool" "$DESTDIR/usr/local/bin/$tool"
done
install -m 0644 systemd/cgpud.service "$DESTDIR/etc/systemd/system/cgpud.service"
make -s -C native BIN="$DESTDIR/usr/local/libexec"
make -s -C native libcgpu LIB="$DESTDIR/usr/local/lib/cgpu"  # the daemon's --libcgpu default
install -m 0644 deploy/hooks.d/cgpu-hook.json "$DESTDIR/etc/containers/oci/hooks.d/cgpu-hook.json"
ln -sfn /usr/local/libexec/cgpu-runtime "$DESTDIR/usr/local/bin/cgpu-runtime"
if [ "$RUNTIMES" = 1 ]; then
  # Docker and containerd, where installed: their settings name cgpu-runtime (others are kept)
  if command -v dockerd >/dev/null || [ -d "$DESTDIR/etc/docker" ]; then
    "$BIN/cgpu" runtime-config docker --root "${DESTDIR:-/}"
  fi
  if command -v containerd >/dev/null || [ -d "$DESTDIR/etc/containerd" ]; then
    "$BIN/cgpu" runtime-config containerd --root "${DESTDIR:-/}"
  fi
fi
if [ ! -e "$DESTDIR/etc/default/cgpud" ]; then
  cat > "$DESTDIR/etc/default/cgpud" <<'EOF'
# Settings of cgpud.service (each is also a `cgpud serve` option; see `cgpud serve --help`).
# CGPUD_GPUS=sim:T4
# CGPUD_ADMIN_GROUP=cgpu
# CGPUD_SLICE_MS=10
# CGPUD_PLACEMENT=binpack
# CGPUD_MODE=cgpu
EOF
fi
echo "install-service: installed the unit, /usr/local/bin/{cgpud,cgpu,cgpu-smi,cgpu-runtime} and the hooks.d file under ${DESTDIR:-/}"

if [ -z "$DESTDIR" ] && [ "$START" = 1 ]; then
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable --now cgpud.service
    systemctl --no-pager status cgpud.service | head -n 5 || true
  else
    echo "install-service: systemd is not running here; start it later with: systemctl enable --now cgpud" >&2
  fi
fi
