"""The experiment config: the schema (``schema.py``), the YAML loader (``load.py``), where relative paths point (``paths.py``)."""
