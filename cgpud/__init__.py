"""cgpud: GPU sharing for containers in user space."""

__version__ = "1.2.0"
