# The two commands of the README. Both install what they need first.
.PHONY: setup run test bench install-hooks

setup:
	./scripts/setup.sh

# The daemon on its embedded default: one simulated Tesla T4.
run: setup
	.venv/bin/cgpud serve --gpus sim:T4

test: setup
	.venv/bin/python -m pytest

bench: setup
	.venv/bin/python bench/tree_ops.py

# The container hook, the runtime wrapper and the in-container library where the shipped configs name them
# (deploy/hooks.d/cgpu-hook.json: /usr/local/libexec/cgpu-hook; Docker and containerd:
# /usr/local/bin/cgpu-runtime). As root; DESTDIR=/some/root stages them there instead.
install-hooks: setup
	install -d $(DESTDIR)/usr/local/libexec $(DESTDIR)/usr/local/bin
	$(MAKE) -s -C native BIN=$(abspath $(DESTDIR)/usr/local/libexec)
	ln -sfn /usr/local/libexec/cgpu-runtime $(DESTDIR)/usr/local/bin/cgpu-runtime
	$(MAKE) -s -C native libcgpu LIB=$(abspath $(DESTDIR)/usr/local/lib/cgpu)
	@echo "install-hooks: $(DESTDIR)/usr/local/libexec/cgpu-hook, $(DESTDIR)/usr/local/bin/cgpu-runtime, $(DESTDIR)/usr/local/lib/cgpu/libcgpu.so"

