"""The model store: each model's shards, DeepSpeed engines, offload, frozen shards and compiled ops."""
