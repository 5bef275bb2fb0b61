"""Data: the packed ``Batch``, JSONL data sets and their loaders, tokenizers, and the shipped synthetic task.

See docs/algorithms.md (Data) for the layouts and the synthetic sort task.
"""
