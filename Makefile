# The two commands of the README. Both install what they need first.
.PHONY: setup run test bench

setup:
	./scripts/setup.sh

# The daemon on its embedded default: one simulated Tesla T4.
run: setup
	.venv/bin/cgpud serve --gpus sim:T4

test: setup
	.venv/bin/python -m pytest

bench: setup
	.venv/bin/python bench/tree_ops.py
