//go:build tools

// The real helm, built from its own Go module by scripts/helm-build.sh (the chart's tests run it).
package tools

import _ "helm.sh/helm/v3/cmd/helm"
