"""Generation options on one process: sampling filters, EOS handling, logprobs, low precision."""

from __future__ import annotations

import pytest
import torch
from model_cases import PROMPTS, sample_sequences

from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.models.packing import pack
from restage.models.parallel import vocab_parallel_logprobs
from restage.rollout.generation import generate
from restage.rollout.sampling import SamplingParams

ONE_RANK = Layout((0,), Strategy())


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], ONE_RANK, None, 0)


def test_sampled_logprobs_equal_a_teacher_forced_forward(llama):
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.9, seed=3, eos_token_ids=())
    out = generate(llama, PROMPTS, params)
    seqs = [p + g for p, g in zip(PROMPTS, out.sequences())]
    tokens, batch = pack(seqs)
    with torch.no_grad():
        logits = llama(tokens, batch)
    targets = torch.cat([tokens[1:], tokens[:1]])
    logprobs = vocab_parallel_logprobs(logits, targets, llama.ctx, 0, temperature=0.7)
    for b, (prompt, start) in enumerate(zip(PROMPTS, batch.cu_seqlens[:-1].tolist())):
        first = start + len(prompt) - 1  # the logits at the prompt's last token pick generated token 0
        expected = logprobs[first: first + int(out.lengths[b])]
        assert torch.allclose(out.logprobs[b, : int(out.lengths[b])], expected, atol=1e-4)


def test_sampling_is_seeded_and_narrow_filters_reduce_to_greedy(llama):
    greedy = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, greedy=True, eos_token_ids=()))
    top1 = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, top_k=1, seed=5, eos_token_ids=()))
    tiny_p = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, top_p=1e-6, seed=6, eos_token_ids=()))
    assert top1.sequences() == greedy.sequences() == tiny_p.sequences()
    a, b, c = (generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, seed=s, eos_token_ids=())) for s in (1, 1, 2))
    assert a.sequences() == b.sequences() and a.sequences() != c.sequences()


def test_each_sequence_stops_at_its_eos_and_min_new_tokens_holds_eos_back(llama):
    greedy = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, greedy=True, eos_token_ids=())).sequences()
    first = greedy[0]
    stop = next(i for i, t in enumerate(first) if first.index(t) == i and i >= 2)  # first occurrence, at step >= 2
    eos = first[stop]
    out = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, greedy=True, eos_token_ids=(eos,), pad_token_id=0))
    for b, seq in enumerate(greedy):
        expected = seq[: seq.index(eos) + 1] if eos in seq else seq
        assert out.sequences()[b] == expected
        assert out.tokens[b, len(expected):].eq(0).all() and out.logprobs[b, len(expected):].eq(0).all()
    held = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, min_new_tokens=stop + 2, greedy=True,
                                                   eos_token_ids=(eos,)))
    assert eos not in held.sequences()[0][: stop + 2] and int(held.lengths[0]) >= stop + 2


# fp16: 0.004 is about two units in the last place at |logit| < 4; CPU fp16 matmul kernels differ by
# machine (0.0024 seen on one where 0.002 had passed on another).
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.02), (torch.float16, 0.004)])
def test_half_precision_logits_track_transformers(tiny_models, dtype, tolerance):
    from restage.models.tiny import load_hf

    seqs = sample_sequences([9, 14], seed=4)
    ours = load_stage(tiny_models["qwen2"], ONE_RANK, None, 0, dtype=dtype)
    hf = load_hf(tiny_models["qwen2"], dtype=dtype)
    tokens, batch = pack(seqs)
    with torch.no_grad():
        logits = ours(tokens, batch)
        reference = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert logits.dtype == dtype and next(ours.parameters()).dtype == dtype
    assert (logits.float() - reference.float()).abs().max().item() <= tolerance
    out = generate(ours, PROMPTS, SamplingParams(max_new_tokens=8, greedy=True, eos_token_ids=()))
    assert out.tokens.shape == (len(PROMPTS), 8) and torch.isfinite(out.logprobs).all()


def test_every_eos_id_of_the_checkpoint_stops_a_sequence(llama, tiny_models, tmp_path, monkeypatch):
    """Llama-3-Instruct lists several EOS ids (config.json and generation_config.json); each ends an answer."""
    import json
    import shutil
    from dataclasses import replace

    from restage.models.arch import ModelConfig

    greedy = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, greedy=True, eos_token_ids=())).sequences()
    first = greedy[0]
    stop = next(i for i, t in enumerate(first) if first.index(t) == i and i >= 2)
    eos = first[stop]
    unused = next(t for t in range(llama.cfg.vocab_size) if all(t not in s for s in greedy))
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "eos_token_id": [unused, unused + 1]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused + 1, eos]}))
    cfg = ModelConfig.from_pretrained(folder)
    assert (cfg.eos_token_id, cfg.stop_token_ids) == (unused, (unused, unused + 1, eos))
    monkeypatch.setattr(llama, "cfg", replace(llama.cfg, eos_token_id=cfg.eos_token_id, eos_token_ids=cfg.eos_token_ids))
    out = generate(llama, PROMPTS, SamplingParams(max_new_tokens=10, greedy=True, pad_token_id=0)).sequences()
    for b, seq in enumerate(greedy):  # the third id, from generation_config.json, ends the answers that reach it
        assert out[b] == (seq[: seq.index(eos) + 1] if eos in seq else seq)
