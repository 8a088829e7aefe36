# The two commands of the README. Both install what they need first.
.PHONY: setup run test test-cluster bench install-hooks gpu-check gpu-bundle test-load

setup:
	./scripts/setup.sh

# The daemon on its embedded default: one simulated Tesla T4.
run: setup
	.venv/bin/cgpud serve --gpus sim:T4

test: setup
	.venv/bin/python -m pytest -n 2

# The cluster tier alone (the real kube-apiserver, kube-scheduler, kubelet and containerd), on the Kubernetes
# release K8S_VERSION: tests/cluster/go.mod's (1.37.2) by default, or one of tests/cluster/versions/ (written by
# scripts/k8s-gomod.sh), built once into /var/cache/cgpud/k8s beside the others (minutes the first time).
# K8S_FEATURE_GATES=A=true,B=false replaces the gates the tier sets for that release (tests/cluster.py).
# docs/kubernetes.md, "Kubernetes versions", says which release ran which module.
K8S_VERSION ?=
CLUSTER_TESTS ?= tests/test_cluster.py tests/test_cluster_lock.py tests/test_cluster_security.py tests/test_modes.py \
	tests/test_cluster_health.py tests/test_cluster_daemonset.py tests/test_cluster_helm.py \
	tests/test_cluster_dra.py tests/test_cluster_dra_health.py tests/test_cluster_podspec.py tests/test_cluster_metrics.py \
	tests/test_cluster_seeds.py
test-cluster: setup
	K8S_VERSION=$(K8S_VERSION) scripts/k8s-build.sh >/dev/null
	K8S_VERSION=$(K8S_VERSION) .venv/bin/python -m pytest -p no:cacheprovider $(CLUSTER_TESTS) $(ARGS)

bench: setup
	.venv/bin/python bench/tree_ops.py

# The timing-sensitive test files under a CPU load (HOGS spinning processes), RUNS runs each, failures
# counted per file (scripts/test_load.py); FILES=... names others.
RUNS ?= 10
HOGS ?= 4
FILES ?=
test-load: setup
	.venv/bin/python scripts/test_load.py --runs $(RUNS) --hogs $(HOGS) $(FILES)

# On a machine with an NVIDIA GPU: cgpud on the real driver, checked through cgpu run with whatever of
# cuda-bindings, PyTorch, CuPy, JAX and nvidia-smi is installed (scripts/gpu_check.py; one table, exit 1
# on a failure). Without a GPU: one line, exit 77 (nothing checked). docs/isolation.md.
# With BUNDLE=<dir> (what make gpu-bundle built elsewhere): no setup, nothing installed on the machine,
# cgpud and its dependencies from the bundle (scripts/gpu_check.sh); ARGS=... passes options on.
BUNDLE ?=
ARGS ?=
gpu-check: $(if $(BUNDLE),,setup)
ifeq ($(BUNDLE),)
	.venv/bin/python scripts/gpu_check.py $(ARGS)
else
	sh scripts/gpu_check.sh $(BUNDLE) $(ARGS)
endif

# What the real-GPU check needs on a GPU machine without network, pyfuse3, trio, tomlkit, libfuse3 or zig,
# built here into one folder (default gpu-bundle/) to carry there: cp312 wheels (pyfuse3 with libfuse3
# inside it), the native programs and libcgpu.so (scripts/gpu_bundle.sh).
gpu-bundle: setup
	bash scripts/gpu_bundle.sh $(or $(BUNDLE),gpu-bundle)

# The container hook, the runtime wrapper and the in-container library where the shipped configs name them
# (deploy/hooks.d/cgpu-hook.json: /usr/local/libexec/cgpu-hook; Docker and containerd:
# /usr/local/bin/cgpu-runtime). As root; DESTDIR=/some/root stages them there instead.
install-hooks: setup
	install -d $(DESTDIR)/usr/local/libexec $(DESTDIR)/usr/local/bin
	$(MAKE) -s -C native BIN=$(abspath $(DESTDIR)/usr/local/libexec)
	ln -sfn /usr/local/libexec/cgpu-runtime $(DESTDIR)/usr/local/bin/cgpu-runtime
	$(MAKE) -s -C native libcgpu LIB=$(abspath $(DESTDIR)/usr/local/lib/cgpu)
	@echo "install-hooks: $(DESTDIR)/usr/local/libexec/cgpu-hook, $(DESTDIR)/usr/local/bin/cgpu-runtime, $(DESTDIR)/usr/local/lib/cgpu/libcgpu.so"

