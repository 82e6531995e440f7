"""interop: checkpoint and config interoperability through one common sharded format."""
__version__ = "0.1.0"
