"""The tiny models and inputs the model tests share, and transformers' reference outputs."""

from __future__ import annotations

import torch

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
# name -> build_tiny keyword arguments. Between them they cover every family, tied and untied
# heads, Mistral's sliding window, Qwen3's q/k norms and explicit head_dim, sharded safetensors,
# pytorch_model.bin, critic heads and mixtures of experts (Mixtral: 4 experts, top 2, renormalised;
# Qwen3-MoE: not renormalised, one dense layer among sparse ones).
MODELS = {
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", tied=True, max_shard_size="100KB"),
    "mistral": dict(family="mistral", sliding_window=8, weight_format="bin"),
    "qwen2": dict(family="qwen2"),
    "qwen2_tied": dict(family="qwen2", tied=True),
    "gpt2": dict(family="gpt2", tied=True),
    "mixtral": dict(family="mixtral"),
    "llama_critic": dict(family="llama", critic=True),
    "gpt2_critic": dict(family="gpt2", critic=True),
    # Qwen3: q/k norms, and head_dim (24, 32) unlike hidden_size / heads (16), so q and o are not square.
    "qwen3": dict(family="qwen3", head_dim=24),
    "qwen3_tied": dict(family="qwen3", tied=True, head_dim=32),
    "qwen3_critic": dict(family="qwen3", critic=True, head_dim=24),
    # Llama 3.1's RoPE, its bands set so that the tiny model's 8 frequencies (wavelengths 6 to 20,000
    # positions) fall in all three: 1 kept, 2 blended, 5 divided by the factor (tests/models/test_rope_on_cpu.py).
    "llama31": dict(family="llama", rope_parameters=LLAMA31_ROPE),
    "qwen3_moe": dict(family="qwen3_moe", head_dim=24),
    "mixtral_critic": dict(family="mixtral", critic=True),
}
CAUSAL = [name for name in MODELS if "critic" not in name]
CRITICS = [name for name in MODELS if "critic" in name]


def sample_sequences(lengths: list[int], seed: int = 0, vocab: int = 257) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


ROLLOUT_EOS = tuple(range(3, 40))  # about one token in seven of sample_sequences' vocabulary stops an answer


def rollout_params(mode: str):
    """The multirank rollout tests' sampling (``greedy`` or seeded ``sampled``), 12 new tokens, ending at ROLLOUT_EOS."""
    from restage.rollout.sampling import SamplingParams

    if mode == "greedy":
        return SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=ROLLOUT_EOS)
    return SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=11, eos_token_ids=ROLLOUT_EOS)


# Two micro-batches of unequal sequences (lengths past Mistral's window of 8).
MICRO_BATCHES = [sample_sequences([7, 20], seed=1), sample_sequences([13, 9, 3], seed=2)]
PROMPTS = sample_sequences([5, 11, 8, 11], seed=3)


def hf_outputs(path: str, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits ``[L, V]`` per sequence (causal LM) or its scalar score (critic)."""
    from restage.models.tiny import load_hf

    model = load_hf(path)
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in seqs]


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from restage.models.tiny import load_hf

    model = load_hf(path)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def logprob_gap_to_teacher_forcing(module, prompts: list[list[int]], out, temperature: float) -> float:
    """Largest |generated log-prob - the same token's log-prob in one forward over prompt + answer| (``out``: a
    GenerationOutput of ``prompts``, one request per prompt, on ``module``'s device)."""
    from restage.models.packing import pack
    from restage.models.parallel import vocab_parallel_logprobs

    device = next(module.parameters()).device
    tokens, batch = pack([p + a for p, a in zip(prompts, out.sequences())], device=device)
    with torch.no_grad():
        logits = module(tokens, batch)
    expected = vocab_parallel_logprobs(logits, torch.roll(tokens, -1), module.ctx, 0, temperature=temperature)
    worst = 0.0
    for r, (prompt, start) in enumerate(zip(prompts, batch.cu_seqlens[:-1].tolist())):
        n, first = int(out.lengths[r]), start + len(prompt) - 1
        worst = max(worst, (out.logprobs[r, :n] - expected[first: first + n]).abs().max().item())
    return worst
