"""Multi-turn rollouts on the rollout engine: an episode's next turn joins the running batch when its observation
is ready, and a turn that ends gives its slot to whichever request waits.

``TurnEngine`` is a ``RolloutEngine`` whose request table has a row per (episode, turn): row
``e * max_turns + t`` is turn ``t`` of episode ``e``. Only the first turns are queued at the start; when a turn
stops (EOS, a stop token such as a tool call's end, or its cap) its slot is retired at once and the ``TurnFeed``
is told (``turn_done``: the tokens it wrote); the feed runs the environment step (a tool in the sandbox) while
the engine keeps decoding the other slots, and at each check hands back the next turns whose observations are
ready (``take_ready``), which are queued and take free slots like any request. Every turn's noise key is its
own (``keys[row]``), so its tokens do not depend on when it was admitted or beside whom.

The next turn's context (prompt, earlier answers and observations) is prefilled whole: the retired slot's keys
and values are not kept for it. Keeping them would hold the slot idle for the whole tool call (the slot is the
unit of KV memory here: ``rollout.py``), which is what giving it to a waiting request avoids; the cost is one
prefill of the context per turn, ``sum_t len(context_t)`` prefill tokens per episode instead of the observation
tokens alone (prefill runs at compute speed, a few decode steps' time for a few hundred tokens), which the
estimator charges (``plan/estimator.py``'s ``multi_turn_tokens``). Sibling episodes of a group share their first
turn's prefill as ``RolloutEngine`` does.

A replica of several ranks (tp, pp) must admit the same turns at the same step: the feed of its first rank
decides (``TurnFeed.take_ready`` is called on every rank; ``runtime/multi_turn.py`` broadcasts the first rank's
choice). Replicas that step in lockstep (ep, ZeRO-3 partitioned) and micro-groups in flight through pp stages
are not used here: pp stages run one after another (``pp_groups=1``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from restage.errors import ConfigError
from restage.models.decoder import StageModule
from restage.models.rollout import RolloutEngine, RolloutLimits, lockstep_group
from restage.models.sampling import SamplingParams, request_keys


@dataclass(frozen=True)
class NextTurn:
    """A turn ready to run: its row, the whole context so far, and how many tokens it may write."""

    row: int
    context: tuple[int, ...]
    max_new: int


class TurnFeed(Protocol):
    def turn_done(self, row: int, tokens: list[int], logprobs: list[float]) -> None:
        """Row ``row``'s turn wrote ``tokens`` (its stop token included); start its environment step."""

    def take_ready(self, block: bool) -> list[NextTurn]:
        """The next turns whose observations are ready (``block``: wait for at least one when any is pending)."""

    def pending(self) -> bool:
        """Whether an environment step is still running (its episode may have a next turn)."""


class TurnEngine(RolloutEngine):
    """``RolloutEngine`` over (episode, turn) rows fed by a ``TurnFeed``; see the module's docstring."""

    def __init__(self, module: StageModule, prompts: Sequence[Sequence[int]], prompt_of: Sequence[int],
                 max_turns: int, first_max_new: Sequence[int], episode_tokens: int, seeds: Sequence[int],
                 params: SamplingParams, eos_ids: Sequence[int], limits: RolloutLimits, feed: TurnFeed):
        episodes = len(prompt_of)
        limits = dataclasses.replace(limits, pp_groups=1)
        # Sized for the longest episode: its prompt plus every answer and observation token of its budget.
        super().__init__(module, list(prompts), prompt_of, [episode_tokens] * episodes,
                         torch.zeros(episodes, dtype=torch.int64), params, eos_ids, limits, decode_mode="eager")
        if lockstep_group(module) is not None:
            raise ConfigError("multi-turn episodes (environment.name) cannot generate on a layout whose replicas step "
                              "in lockstep (expert parallelism, or ZeRO-3 generation in place); give actor_gen a "
                              "layout with ep 1 and no ZeRO-3 partitioning")
        rows = episodes * max_turns
        self.feed, self.max_turns = feed, max_turns
        self.contexts = [tuple(p) for p in prompts]  # grows: each later turn's context is a new prompt
        self.prompts = self.contexts
        self.prompt_of = [-1] * rows
        self.max_new = [0] * rows
        self.started = [0] * rows
        for e in range(episodes):
            self.prompt_of[e * max_turns] = prompt_of[e]
            self.max_new[e * max_turns] = first_max_new[e]
        self.must_finish = rows
        self.keys = request_keys(list(seeds)).to(self.device)
        width = self.tokens.shape[1]
        self.tokens = torch.full((rows + 1, width), params.pad_token_id, dtype=torch.int64, device=self.device)
        self.logprobs = torch.zeros(rows + 1, width, dtype=torch.float32, device=self.device)
        self.lengths = torch.zeros(rows + 1, dtype=torch.int64, device=self.device)
        self.queue = deque(e * max_turns for e in range(episodes))
        self.finished_rows: list[int] = []
        self.prefill_tokens = 0  # tokens prefilled over the run (every turn's context; the estimator's figure)

    def _retire(self, slots: list[int]) -> None:
        self.finished_rows.extend(self.request[i] for i in slots if self.request[i] >= 0)
        super()._retire(slots)

    def _prefill(self, slots: list[int], prefixes) -> None:
        self.prefill_tokens += sum(len(p) for p in prefixes)
        super()._prefill(slots, prefixes)

    def _hand_over(self) -> None:
        """Tell the feed which turns ended since the last call (one read of their tokens)."""
        if not self.finished_rows:
            return
        rows, self.finished_rows = self.finished_rows, []
        index = torch.tensor(rows).to(self.device)
        lengths = self.lengths.index_select(0, index).tolist()
        tokens = self.tokens.index_select(0, index).tolist()
        logprobs = self.logprobs.index_select(0, index).tolist()
        for row, n, t, lp in zip(rows, lengths, tokens, logprobs):
            self.feed.turn_done(row, t[:n], lp[:n])

    def _queue_ready(self, block: bool) -> None:
        for turn in self.feed.take_ready(block):
            if not 0 < turn.max_new <= self.tokens.shape[1] or turn.row % self.max_turns == 0:
                raise ValueError(f"turn row {turn.row}: max_new {turn.max_new} outside 1..{self.tokens.shape[1]}")
            self.contexts.append(turn.context)
            self.prompt_of[turn.row] = len(self.contexts) - 1
            self.max_new[turn.row] = turn.max_new
            self.queue.append(turn.row)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run every episode to its end: ``(tokens [rows, W], logprobs [rows, W], lengths [rows])``, row per turn."""
        while True:
            self.reap()
            self._hand_over()
            idle = not self.queue and self.bound() == 0
            self._queue_ready(block=idle)
            if not self.queue and self.bound() == 0 and not self.feed.pending():
                break
            self._admit(join_if_empty=False)
            for _ in range(self.limits.check_every_steps):
                if self.queue and -1 in self.request:
                    self._admit(join_if_empty=False)
                if not self.bound():
                    break
                self._decode()
        return self.tokens[:-1], self.logprobs[:-1], self.lengths[:-1]
