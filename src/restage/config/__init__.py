"""The experiment config: the config and its checks (``schema.py``), its sections (``sections.py``) and closed
choices (``choices.py``), the YAML loader (``load.py``), where relative paths point (``paths.py``)."""
