# Sourced by scripts/k8s-build.sh and scripts/containerd-build.sh: `find_go GO_MOD CACHE` prints a
# Go new enough for GO_MOD's go line: the one named by GO, else on PATH or in /usr/local/go, else
# the Go toolchain module of that release (golang.org/toolchain, what GOTOOLCHAIN=goX fetches) from
# the Go module proxy, once, into CACHE/go.
find_go() {
  local gomod="$1" cache="$2" need toolchain=go1.26.8 g v arch zip
  need="$(awk '$1=="go" {print $2; exit}' "$gomod")"
  new_enough() { [ -x "$1" ] && v="$("$1" env GOVERSION 2>/dev/null)" && v="${v#go}" &&
                 [ "$(printf '%s\n%s\n' "$need" "$v" | sort -V | head -1)" = "$need" ]; }
  if [ -n "${GO:-}" ]; then echo "$GO"; return; fi
  for g in "$(command -v go || true)" /usr/local/go/bin/go "$cache/go/$toolchain/bin/go"; do
    if [ -n "$g" ] && GOTOOLCHAIN=local new_enough "$g"; then echo "$g"; return; fi
  done
  echo "no Go >= $need here: fetching the $toolchain toolchain module from the Go module proxy" >&2
  arch="$(uname -m)"; case "$arch" in x86_64) arch=amd64;; aarch64) arch=arm64;; esac
  zip="$cache/go/$toolchain.zip"; mkdir -p "$cache/go"
  curl -fsSL -o "$zip" "${GOPROXY_URL:-https://proxy.golang.org}/golang.org/toolchain/@v/v0.0.1-$toolchain.linux-$arch.zip"
  rm -rf "$cache/go/unpack"; mkdir "$cache/go/unpack"; (cd "$cache/go/unpack" && unzip -q "$zip")
  mv "$cache/go/unpack/golang.org/toolchain@v0.0.1-$toolchain.linux-$arch" "$cache/go/$toolchain"
  rm -rf "$cache/go/unpack" "$zip"; chmod +x "$cache/go/$toolchain/bin/"* "$cache/go/$toolchain/pkg/tool/"*/* 2>/dev/null || true
  echo "$cache/go/$toolchain/bin/go"
}
