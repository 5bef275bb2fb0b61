"""The rollout engine: continuous batching over a KV cache (contiguous or paged), decode graphs, sampling, multi-turn."""
