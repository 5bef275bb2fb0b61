"""A plain single-process stand-in for the runtime: a tiny HF model, padded forward, sampling.

Only for the sanity tests of the losses; the runtime has its own packed decoder.
"""

import torch

from restage.algorithms import packed_ops
from restage.data.batch import Batch, pack_sequences


def tiny_model(seed=0, vocab_size=16, scalar_head=False):
    """A 2-layer LLaMA of width 64; ``scalar_head``: one value per token (critic / reward model) instead of logits."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, num_labels=1)
    torch.manual_seed(seed)
    if scalar_head:
        return transformers.AutoModelForTokenClassification.from_config(config, attn_implementation="eager")
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def packed_logits(model, ids, batch: Batch):
    """``[T, V]`` logits of every packed token (the sequences run right-padded side by side)."""
    n, width = batch.n_seqs, max(batch.seqlens)
    padded = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    start = 0
    for i, length in enumerate(batch.seqlens):
        padded[i, :length] = ids[start:start + length]
        attention[i, :length] = 1
        start += length
    logits = model(input_ids=padded, attention_mask=attention).logits
    return logits[attention.bool()]


def logprobs(model, batch: Batch, key: str):
    return packed_ops.token_logprobs(packed_logits(model, batch[key], batch), batch[key], batch.cu_seqlens)


@torch.no_grad()
def sample(model, prompt_batch: Batch, group_size: int, max_new_tokens: int, eos_id: int = 2, generator=None) -> Batch:
    """``group_size`` sampled answers per prompt, packed with ``prompt_mask``; stops at EOS."""
    prompts = [t.tolist() for t in torch.split(prompt_batch["prompts"], list(prompt_batch.seqlens))]
    seqs = [list(p) for p in prompts for _ in range(group_size)]
    prompt_lens = [len(s) for s in seqs]
    done = [False] * len(seqs)
    for _ in range(max_new_tokens):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        batch = pack_sequences([seqs[i] for i in live])
        logits = packed_logits(model, batch["seqs"], batch)[batch.cu_seqlens[1:].long() - 1]
        tokens = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator).squeeze(-1).tolist()
        for i, token in zip(live, tokens):
            seqs[i].append(token)
            done[i] = token == eos_id
    return pack_sequences(seqs, group_size=group_size, prompt_lens=prompt_lens)
