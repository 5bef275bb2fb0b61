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
unit of KV memory here: ``engine.py``), which is what giving it to a waiting request avoids; the cost is one
prefill of the context per turn, ``sum_t len(context_t)`` prefill tokens per episode instead of the observation
tokens alone (prefill runs at compute speed, a few decode steps' time for a few hundred tokens), which the
estimator charges (``plan/estimator.py``'s ``multi_turn_tokens``). Sibling episodes of a group share their first
turn's prefill as ``RolloutEngine`` does.

Partial rollouts (``runtime/step/partial_episodes.py``): the rows cover two batches' episodes, ``run`` stops once the
first batch's (``required``) are done, and ``open_turns`` gives the later ones' turns begun or queued, each with its
tokens so far; a start with tokens (``NextTurn.tokens``) is such a turn continued: prefilled as context + tokens and
decoded on from its position (``RolloutEngine.started``), so its noise continues where it stopped.

A replica of several ranks (tp, pp) must admit the same turns at the same step: the feed of its first rank
decides (``TurnFeed.take_ready`` is called on every rank; ``runtime/step/multi_turn.py`` broadcasts the first rank's
choice). Replicas that step in lockstep (ep, ZeRO-3 partitioned) run the same forwards (``TurnEngine.run``): a
replica whose episodes wait on tools joins its peers' steps. Micro-groups in flight through pp stages are not used
here: pp stages run one after another (``pp_groups=1``).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from restage.models.decoder import StageModule
from restage.rollout.budget import RolloutLimits
from restage.rollout.engine import RolloutEngine
from restage.rollout.lockstep import join_step
from restage.rollout.sampling import SamplingParams, request_keys

LOCKSTEP_WAIT_SECONDS = 0.02  # how long replicas in lockstep, all waiting on tools, wait before agreeing again


@dataclass(frozen=True)
class NextTurn:
    """A turn ready to run: its row, the whole context before it, how many tokens it may write, and the tokens it
    wrote before (with their log-probs): a turn a partial rollout cut is continued, else empty."""

    row: int
    context: tuple[int, ...]
    max_new: int
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


class TurnFeed(Protocol):
    def turn_done(self, row: int, tokens: list[int], logprobs: list[float]) -> None:
        """Row ``row``'s turn wrote ``tokens`` (its stop token included); start its environment step."""

    def take_ready(self, block: bool, timeout: float | None = None) -> list[NextTurn]:
        """The next turns whose observations are ready (``block``: wait, at most ``timeout`` seconds when given,
        for at least one of a required episode's when any is pending)."""

    def pending(self) -> bool:
        """Whether an environment step of a required episode is still running (it may have a next turn)."""


class TurnEngine(RolloutEngine):
    """``RolloutEngine`` over (episode, turn) rows fed by a ``TurnFeed``; see the module's docstring.

    ``starts``: the turns queued at the start (required episodes' first), each a first turn or a turn to continue;
    ``episodes``: how many episodes the rows cover; ``required``: ``run`` stops once episodes ``0 .. required - 1``
    are done (partial rollouts: the later ones are left as ``open_turns`` and the feed's pending steps);
    ``max_len``: a slot's length, the longest episode's prompt + ``episode_tokens``."""

    def __init__(self, module: StageModule, starts: Sequence[NextTurn], episodes: int, required: int, max_turns: int,
                 episode_tokens: int, max_len: int, seeds: Sequence[int], params: SamplingParams,
                 eos_ids: Sequence[int], limits: RolloutLimits, feed: TurnFeed):
        limits = dataclasses.replace(limits, pp_groups=1)
        prompts: list[tuple[int, ...]] = []
        unique: dict[tuple[int, ...], int] = {}  # sibling first turns with one context share its prefill
        start_prompt = []  # each start's prompt: its context (+ its tokens so far, a continued turn)
        for turn in starts:
            if turn.tokens:
                start_prompt.append(len(prompts))
                prompts.append(turn.context + turn.tokens)
            else:
                start_prompt.append(unique.setdefault(turn.context, len(prompts)))
                if start_prompt[-1] == len(prompts):
                    prompts.append(turn.context)
        rows = episodes * max_turns
        prompt_of = [-1] * rows  # a later turn's prompt is known when its observation is (_queue_ready)
        max_new, started = [0] * rows, [0] * rows
        for turn, prompt in zip(starts, start_prompt):
            if not 0 < turn.max_new <= episode_tokens or len(turn.tokens) >= turn.max_new:
                raise ValueError(f"turn row {turn.row}: max_new {turn.max_new} outside {len(turn.tokens) + 1}.."
                                 f"{episode_tokens}")
            prompt_of[turn.row], max_new[turn.row], started[turn.row] = prompt, turn.max_new, len(turn.tokens)
        # The slots are sized for the required episodes (partial rollouts: later ones take slots they free).
        super().__init__(module, prompts, prompt_of, max_new, request_keys(list(seeds)), params, eos_ids, limits,
                         decode_mode="eager", started=started, must_finish=max(1, required), max_len=max_len,
                         queue=[turn.row for turn in starts], width=episode_tokens)
        self.feed, self.max_turns, self.required_rows = feed, max_turns, required * max_turns
        self.contexts = prompts  # grows: each later turn's context is a new prompt
        for turn in starts:  # a continued turn's tokens so far (its length is ``started``)
            if turn.tokens:
                n = len(turn.tokens)
                self.tokens[turn.row, :n] = torch.tensor(turn.tokens, dtype=torch.int64).to(self.device)
                self.logprobs[turn.row, :n] = torch.tensor(turn.logprobs, dtype=torch.float32).to(self.device)
        self.finished_rows: list[int] = []
        self.prefill_tokens = 0  # tokens prefilled over the run (every turn's context; the estimator's figure)

    def _retire(self, slots: list[int]) -> None:
        self.finished_rows.extend(row for i in slots if (row := self.slots.request(i)) is not None)
        super()._retire(slots)

    def _prefill(self, slots: list[int], prefixes: list[Sequence[int]]) -> None:
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

    def _queue_ready(self, block: bool, timeout: float | None = None) -> None:
        for turn in self.feed.take_ready(block, timeout):
            if not 0 < turn.max_new <= self.tokens.shape[1] or turn.row % self.max_turns == 0 or turn.tokens:
                raise ValueError(f"turn row {turn.row}: max_new {turn.max_new} outside 1..{self.tokens.shape[1]}")
            self.contexts.append(turn.context)
            self.prompt_of[turn.row] = len(self.contexts) - 1
            self.max_new[turn.row] = turn.max_new
            self.queue.append(turn.row)
        if self.required_rows < len(self.prompt_of):  # required episodes' turns first (a stable sort)
            self.queue = deque(sorted(self.queue, key=lambda row: row >= self.required_rows))

    def required_done(self) -> bool:
        """Whether the required episodes are all done: none of their turns waits, decodes or awaits its tool."""
        return (all(row >= self.required_rows for row in self.queue)
                and all(row >= self.required_rows for row in self.requests_in_slots()) and not self.feed.pending())

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the required episodes to their ends: ``(tokens [rows, W], logprobs [rows, W], lengths [rows])``, row
        per turn (a later episode's open turn holds its tokens so far).

        Replicas in lockstep (``lockstep_group``: ep, ZeRO-3 in place) run the same forwards: each check, one
        agreement (all done? all idle?), then one prefill or join and ``check_every_steps`` decodes or joins on
        every replica, as ``RolloutEngine.run``; a replica whose episodes wait on tools joins its peers' steps
        instead of blocking, and when every replica waits each waits ``LOCKSTEP_WAIT_SECONDS`` at most on its
        own tools before they agree again."""
        lockstep = self.lockstep is not None
        while True:
            self.reap()
            self._hand_over()
            idle = not self.queue and self.bound() == 0
            self._queue_ready(block=idle and not lockstep)
            done, all_idle = self._agree(self.required_done(), not self.queue and self.bound() == 0)
            if done:
                break
            if all_idle:  # lockstep: no replica has a turn to run; wait a little on our tools, then agree again
                self._queue_ready(block=True, timeout=LOCKSTEP_WAIT_SECONDS)
                continue
            self._admit(join_if_empty=lockstep)
            for _ in range(self.limits.check_every_steps):
                if not lockstep and self.queue and self.has_free():
                    self._admit(join_if_empty=False)  # without lockstep a free slot is filled at once
                if self.bound():
                    self._decode()
                elif lockstep:
                    join_step(self.module)
                else:
                    break
        return self.tokens[:-1], self.logprobs[:-1], self.lengths[:-1]

    def _agree(self, done: bool, idle: bool) -> tuple[bool, bool]:
        """(every replica done, every replica idle) over the lockstep group (one all-reduce); ``(done, False)``
        without one."""
        if self.lockstep is None:
            return done, False
        flags = torch.tensor([int(done), int(idle)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.lockstep)
        return bool(flags[0].item()), bool(flags[1].item())

    def open_turns(self) -> list[NextTurn]:
        """After ``run``: the turns begun or queued and not finished (later episodes'), in row order, each with its
        context and the tokens written so far (one read of their rows)."""
        rows = sorted(self.requests_in_slots() + list(self.queue))
        if not rows:
            return []
        index = torch.tensor(rows).to(self.device)
        lengths = self.lengths.index_select(0, index).tolist()
        tokens = self.tokens.index_select(0, index).tolist()
        logprobs = self.logprobs.index_select(0, index).tolist()
        out = []
        for row, n, t, lp in zip(rows, lengths, tokens, logprobs):
            prompt = self.contexts[self.prompt_of[row]]
            context = tuple(prompt[:len(prompt) - self.started[row]])
            out.append(NextTurn(row, context, self.max_new[row], tuple(t[:n]), tuple(lp[:n])))
        return out
