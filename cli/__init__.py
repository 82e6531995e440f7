"""The click layer: thin commands over functions of the Python API."""
