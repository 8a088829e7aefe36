"""Command-line entry points: cgpud (the daemon), cgpu, cgpu-smi."""
