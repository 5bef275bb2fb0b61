"""Data sets in the common layouts, tokenised and collated into packed ``Batch``es.

Rows come from JSONL, parquet or a HF ``datasets`` directory, with field names mapped by
``dataset.fields`` (``data/sources.py``); the layouts, by their default field names:

* ``prompt``      ``{"prompt": str}``                              -> key ``prompts``
* ``sft``         ``{"prompt": str, "answer": str}``               -> keys ``packed_input_ids``, ``prompt_mask``
  (an answer may be a multi-turn episode, a list of turns: ``prompt_mask`` is then 1 on its non-assistant turns too)
* ``preference``  ``{"prompt": str, "chosen": str, "rejected": str}`` -> keys ``packed_pair_ids``, ``prompt_mask``
  (chosen then rejected, ``group_size`` 2)

A prompt is ``[BOS] + prompt tokens`` (or the chat template's ids, or pre-tokenised ids: ``data/chat.py``),
cut from the left to ``max_prompt_tokens`` (BOS kept; ``cut_prompts_warning``, the master's one line at
start-up, says how many); an answer is ``answer tokens + [EOS]``, cut from the right to ``max_answer_tokens``.
The held-out split is the last ``round(n * eval_fraction)`` rows, or the ``eval_split`` of the same directory,
or the rows of ``eval_path``. A row's other fields stay with its
example (``Example.fields``) for the reward function.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from restage.config.choices import DatasetKind, check_choice
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch, pack_sequences
from restage.data.chat import answer_ids, cut_prompt, episode_answer_ids, full_prompt_ids
from restage.data.sources import ROLES as FIELDS
from restage.data.sources import read_rows, select_roles
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError


@dataclass(frozen=True)
class Example:
    """One tokenised line: the prompt ids and 0 (prompt), 1 (sft) or 2 (chosen, rejected) answers."""

    index: int  # line number - 1
    prompt: tuple[int, ...]
    answers: tuple[tuple[int, ...], ...] = ()
    fields: Mapping = field(default_factory=dict, compare=False)  # the row's other fields, for the reward
    observed: tuple[bool, ...] = ()  # sft episodes: True on the answer's tokens the policy did not write


def tokenize(rows: Sequence[dict], kind: DatasetKind | str, tokenizer, max_prompt_tokens: int, max_answer_tokens: int,
             first_index: int = 0, chat_template: bool = False, cut: list[tuple[int, int]] | None = None) -> list[Example]:
    """Encode rows of one layout; refuses an empty prompt or answer with its line number. ``cut`` (when given)
    receives (line number, tokens before the cut) of each prompt cut to ``max_prompt_tokens``."""
    layout: DatasetKind = check_choice(kind, DatasetKind, "dataset.kind")  # a test's or a tool's plain name too
    episodes = layout is DatasetKind.SFT  # only an sft answer may be a list of turns (data/chat.py)
    if max_prompt_tokens < 1 or max_answer_tokens < 1:
        raise ConfigError("dataset.max_prompt_tokens and dataset.max_answer_tokens must be >= 1")
    out = []
    for i, row in enumerate(rows, first_index):
        if chat_template and episodes and isinstance(row["answer"], list):
            raise ConfigError(f"line {i + 1}: an answer given as turns is read as plain text; set "
                              "dataset.chat_template=false")
        full = full_prompt_ids(tokenizer, row["prompt"], chat_template)
        prompt = cut_prompt(full, max_prompt_tokens, tokenizer.bos_token_id)
        if cut is not None and len(full) > max_prompt_tokens:
            cut.append((i - first_index + 1, len(full)))
        if not prompt:
            raise ConfigError(f"line {i + 1}: the prompt encodes to no tokens")
        if episodes and isinstance(row["answer"], list):  # a multi-turn episode (data/chat.py)
            answer, observed = episode_answer_ids(tokenizer, row["answer"], max_answer_tokens)
            out.append(Example(i, prompt, (answer,), row.get("fields", {}), observed))
            continue
        answers = tuple(answer_ids(tokenizer, row[name], max_answer_tokens) for name in FIELDS[layout][1:])
        out.append(Example(i, prompt, answers, row.get("fields", {})))
    return out


def collate(examples: Sequence[Example], kind: DatasetKind | str) -> Batch:
    """The packed batch of a list of examples, with the keys the algorithms' MFCs read (see module doc)."""
    ids = [e.index for e in examples]
    layout: DatasetKind = check_choice(kind, DatasetKind, "dataset.kind")
    match layout:
        case DatasetKind.PROMPT:
            return pack_sequences([e.prompt for e in examples], key="prompts", ids=ids)
        case DatasetKind.SFT:
            batch = pack_sequences([e.prompt + e.answers[0] for e in examples], key="packed_input_ids",
                                   prompt_lens=[len(e.prompt) for e in examples], ids=ids)
            if any(e.observed for e in examples):  # episodes: observation tokens join the prompt in prompt_mask
                batch.tokens["prompt_mask"] = torch.tensor([b for e in examples for b in (True,) * len(e.prompt)
                                                            + (e.observed or (False,) * len(e.answers[0]))])
            return batch
        case DatasetKind.PREFERENCE:
            seqs = [e.prompt + answer for e in examples for answer in e.answers]
            return pack_sequences(seqs, group_size=2, key="packed_pair_ids",
                                  prompt_lens=[len(e.prompt) for e in examples for _ in e.answers], ids=ids)
        case unknown:
            typing.assert_never(unknown)


@dataclass(frozen=True)
class Dataset:
    kind: DatasetKind
    examples: tuple[Example, ...]
    # (file, line number, tokens before the cut) of each prompt longer than dataset.max_prompt_tokens
    cut_prompts: tuple[tuple[str, int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, positions: Sequence[int]) -> Batch:
        """The packed batch of the examples at these positions of this split."""
        return collate([self.examples[p] for p in positions], self.kind)


@dataclass
class Cursor:
    """Walks a split in batches, reshuffled every epoch from ``seed``; its state goes into checkpoints."""

    size: int
    seed: int = 1
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _cached: tuple[int, list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def _order(self) -> list[int]:
        # Shuffled once per epoch, not once per batch (a whole data set's shuffle every step adds up).
        if self._cached is not None and self._cached[0] == self.epoch:
            return self._cached[1]
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        self._cached = (self.epoch, order)
        return order

    def next(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` positions; an epoch's leftover too small for a batch is skipped."""
        if batch_size > self.size:
            raise ConfigError(f"run.batch_size {batch_size} exceeds the {self.size} examples of the data set")
        if self.position + batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        out = self._order()[self.position:self.position + batch_size]
        self.position += batch_size
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def default_tokenizer_dir(cfg: ExperimentConfig) -> str:
    if cfg.dataset.tokenizer:
        return cfg.dataset.tokenizer
    model = cfg.models.get("actor") or next(iter(cfg.models.values()))
    return model.path


def check_positions(cfg: ExperimentConfig, splits: Sequence[Dataset], positions: dict[str, int]) -> None:
    """Refuse, in one line naming the line, data whose longest sequence (the prompt plus
    ``generation.max_new_tokens``, or plus its answer) is longer than the fewest positions of the models
    (``positions``: model name -> max_position_embeddings)."""
    examples = [e for split in splits for e in split.examples]
    if not positions or not examples:
        return
    name, limit = min(positions.items(), key=lambda item: item[1])
    answers_generated = cfg.dataset.kind is DatasetKind.PROMPT
    generated = cfg.generation.max_new_tokens if answers_generated else 0

    def answer_tokens(e: Example) -> int:
        return max((len(a) for a in e.answers), default=generated)

    longest = max(examples, key=lambda e: len(e.prompt) + answer_tokens(e))
    prompt, answer = len(longest.prompt), answer_tokens(longest)
    if prompt + answer <= limit:
        return
    where = f"models.{name} has {limit} positions (max_position_embeddings)"
    if answers_generated:
        if generated >= limit:
            raise ConfigError(f"generation.max_new_tokens {generated} leaves no room for a prompt: {where}; lower it")
        raise ConfigError(f"{cfg.dataset.path}:{longest.index + 1}: the prompt is {prompt} tokens, and with "
                          f"generation.max_new_tokens {generated} a sequence reaches {prompt + generated}, but {where}; "
                          f"set dataset.max_prompt_tokens <= {limit - generated} (prompts are cut from the left) or "
                          "lower generation.max_new_tokens")
    raise ConfigError(f"{cfg.dataset.path}:{longest.index + 1}: prompt and answer are {prompt} + {answer} = "
                      f"{prompt + answer} tokens, but {where}; lower dataset.max_prompt_tokens and "
                      f"dataset.max_answer_tokens to sum to <= {limit}")


def load_splits(cfg: ExperimentConfig, tokenizer=None) -> tuple[Dataset, Dataset]:
    """(train, eval) splits of ``cfg.dataset``; eval is empty when ``eval_fraction`` is 0."""
    ds = cfg.dataset
    if not 0.0 <= ds.eval_fraction < 1.0:
        raise ConfigError(f"dataset.eval_fraction: {ds.eval_fraction} must be in [0, 1)")
    tokenizer = tokenizer or load_tokenizer(default_tokenizer_dir(cfg))

    def encode(path: str, split: str, first_index: int) -> Dataset:
        rows = select_roles(read_rows(path, split), ds.kind, ds.fields, path)
        cut: list[tuple[int, int]] = []
        examples = tokenize(rows, ds.kind, tokenizer, ds.max_prompt_tokens, ds.max_answer_tokens, first_index,
                            ds.chat_template, cut)
        return Dataset(ds.kind, tuple(examples), tuple((path, line, tokens) for line, tokens in cut))

    train = encode(ds.path, ds.split, 0)
    if ds.eval_split or ds.eval_path:  # sample ids go on after the training rows': one id space
        return train, encode(ds.eval_path or ds.path, ds.eval_split or ds.split, len(train))
    n_eval = round(len(train) * ds.eval_fraction)
    if n_eval == len(train):
        raise ConfigError(f"dataset.eval_fraction {ds.eval_fraction} leaves no training examples")
    first_held_out = len(train) - n_eval  # row position = sample id = line - 1
    return (Dataset(ds.kind, train.examples[:first_held_out], tuple(c for c in train.cut_prompts if c[1] <= first_held_out)),
            Dataset(ds.kind, train.examples[first_held_out:], tuple(c for c in train.cut_prompts if c[1] > first_held_out)))


def cut_prompts_warning(cfg: ExperimentConfig, *splits: Dataset) -> str:
    """One line when prompts were cut to ``dataset.max_prompt_tokens`` (silently dropping their start), else ""."""
    cut = [c for split in splits for c in split.cut_prompts]
    if not cut:
        return ""
    path, line, tokens = max(cut, key=lambda c: c[2])
    total = sum(len(split) for split in splits)
    return (f"warning: {len(cut):,} of {total:,} prompts are longer than dataset.max_prompt_tokens="
            f"{cfg.dataset.max_prompt_tokens} and are cut from the left (the longest: {path}:{line}, {tokens:,} "
            "tokens); raise dataset.max_prompt_tokens to keep them whole, or shorten them")


def sample_fields(*splits: Dataset) -> dict[int, Mapping]:
    """Sample id -> the row's other fields, over the splits (what a reward function receives as keywords)."""
    return {e.index: e.fields for split in splits for e in split.examples}
