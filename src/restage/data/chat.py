"""Turning a row's prompt or answer into token ids: text, chat messages through the tokenizer's template, or ids.

* text, ``dataset.chat_template`` off: ``[BOS] + tokens`` (``encode_prompt``);
* text or a message list, ``dataset.chat_template`` on: ``tokenizer.apply_chat_template(messages,
  add_generation_prompt=True)`` (text becomes one user message); the template owns the special tokens;
* token ids (pre-tokenised): taken as they are;
* an SFT answer given as a list of turns (``[{"role": "assistant", "content": "<call> 7 * 4 8 </call>"},
  {"role": "tool", "content": "<result> 3 3 6 </result>"}, {"role": "assistant", "content": "3 3 6"}]``, chat
  template off): a multi-turn episode, each turn's text encoded on its own; the non-assistant turns take no loss
  (``episode_answer_ids``).

Prompts are cut from the left to ``max_tokens`` (a leading BOS kept), answers from the right, after
an EOS is appended when the ids do not end with one.
"""

from __future__ import annotations

from restage.errors import ConfigError


def encode_prompt(tokenizer, text: str, max_tokens: int) -> tuple[int, ...]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    keep = max(0, max_tokens - len(bos))
    return tuple(bos + (ids[max(0, len(ids) - keep):] if keep else []))


def encode_answer(tokenizer, text: str, max_tokens: int) -> tuple[int, ...]:
    ids = list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
    return tuple(ids[:max_tokens])


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The template's ids for ``messages`` with the assistant's generation prompt after them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"dataset.chat_template is true but the tokenizer in {tokenizer.name_or_path} has no "
                          "chat_template: neither a chat_template.jinja file (where transformers 5 saves it) nor a "
                          "chat_template entry in tokenizer_config.json (older checkpoints); use a checkpoint with "
                          "one, add one of the two, or set dataset.chat_template=false")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


def full_prompt_ids(tokenizer, value, chat_template: bool) -> list[int]:
    """The prompt's ids before any cut (see module doc); ``value`` is text, a message list or a tuple of ids."""
    if isinstance(value, tuple):
        return list(value)
    if chat_template:
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": value}] if isinstance(value, str) else value)
    if isinstance(value, list):
        raise ConfigError("a prompt is a list of chat messages; set dataset.chat_template=true to apply the "
                          "tokenizer's chat template")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + list(tokenizer.encode(value, add_special_tokens=False))


def cut_prompt(ids: list[int], max_tokens: int, bos_token_id: int | None) -> tuple[int, ...]:
    """``ids`` cut from the left to ``max_tokens``, a leading BOS kept."""
    keep_first = bool(ids) and ids[0] == bos_token_id and len(ids) > max_tokens
    head = ids[:1] if keep_first else []
    room = max(0, max_tokens - len(head))
    return tuple(head + (ids[max(len(head), len(ids) - room):] if room else []))


def prompt_ids(tokenizer, value, max_tokens: int, chat_template: bool) -> tuple[int, ...]:
    """The prompt's ids (see module doc), cut to ``max_tokens``; ``value`` is text, a message list or a tuple of ids."""
    return cut_prompt(full_prompt_ids(tokenizer, value, chat_template), max_tokens, tokenizer.bos_token_id)


def episode_answer_ids(tokenizer, turns: list[dict], max_tokens: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """A multi-turn episode's answer (an SFT demonstration): the ids of its turns' texts, each encoded on its own
    as the episode driver encodes them (``runtime/step/multi_turn.py``), then EOS, cut from the right; and the mask of
    the tokens the policy does not write (every turn whose role is not ``assistant``: tool outputs, observations),
    which SFT, like RL, gives no loss."""
    ids: list[int] = []
    observed: list[bool] = []
    for turn in turns:
        part = list(tokenizer.encode(turn["content"], add_special_tokens=False))
        ids += part
        observed += [turn["role"] != "assistant"] * len(part)
    return tuple((ids + [tokenizer.eos_token_id])[:max_tokens]), tuple((observed + [False])[:max_tokens])


def answer_ids(tokenizer, value, max_tokens: int) -> tuple[int, ...]:
    """The answer's ids: text or pre-tokenised ids, then EOS, cut from the right."""
    if isinstance(value, list):
        raise ConfigError("an answer is a list of chat messages; give answers as text or token ids (an SFT "
                          "answer may be a list of turns: dataset.kind=sft, dataset.chat_template=false)")
    if isinstance(value, str):
        return encode_answer(tokenizer, value, max_tokens)
    ids = list(value)
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids[:max_tokens])
