"""A declared tree of small control files, served over pyfuse3 and trio.

Generic: it knows nothing of GPUs. An application declares its tree once
(`node.Dir`, `node.DynDir`, `node.File`), hands it to `operations.Operations`
together with a table mapping its own exception types to errnos, and mounts it
with `handover.FuseServer` (which can also take over a live connection).
"""
from .node import Dir, DynDir, File, Key, InvalidInput, parse_uint, parse_bool

__all__ = ["Dir", "DynDir", "File", "Key", "InvalidInput", "parse_uint", "parse_bool"]
