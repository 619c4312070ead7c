"""One process's work: its shards' conversations turned into requests, replies turned into shards.

Follow-up turns go before new conversations, so that the shards already open finish (and commit)
first: a killed run loses at most the shards in flight, and a process keeps only a shard or two of
conversations in memory. New conversations come in plan order, shard after shard, so rows never wait
at a shard boundary.

A prompt is the conversation so far rendered with the target's chat template (with the run's
`--chat-template-kwargs`) and the generation prompt, tokenized as extraction tokenizes (the template
writes BOS itself). A prompt that leaves no room for a reply in a row's capacity ends the replay
(reason 'context'); as the first prompt, it drops the conversation. A template that refuses the
conversation drops it, as extraction would skip it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dflash_pipeline.extract.readers import MAX_PROBLEMS_KEPT, BadRowError
from dflash_pipeline.generate.conversations import Replay, Reply
from dflash_pipeline.generate.engine import Finished, Request
from dflash_pipeline.generate.sampling import row_seed
from dflash_pipeline.schemas.generate import CONTEXT, LENGTH, STOP

PROMPT_TOO_LONG = "first prompt longer than --max-length"


@dataclass
class ShardCounts:
    """What happened to one shard's conversations; summed over shards for the run record."""

    conversations: int = 0           # planned
    rows: int = 0                    # written (conversations with at least one reply)
    replies: int = 0                 # kept replies
    reply_tokens: int = 0            # tokens of kept replies, stop tokens included
    prompt_tokens: int = 0
    finish: Counter = field(default_factory=Counter)       # kept replies by why they ended
    empty_replies: int = 0           # dropped
    ended_early: Counter = field(default_factory=Counter)  # replays stopped before their last slot, by reason
    dropped: Counter = field(default_factory=Counter)      # conversations without any reply, by reason
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def truncated(self) -> int:
        return self.finish[LENGTH] + self.finish[CONTEXT]

    def add(self, other: "ShardCounts") -> None:
        for name in ("conversations", "rows", "replies", "reply_tokens", "prompt_tokens", "empty_replies"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.finish.update(other.finish)
        self.ended_early.update(other.ended_early)
        self.dropped.update(other.dropped)
        self.problems.extend(other.problems[: max(0, MAX_PROBLEMS_KEPT - len(self.problems))])

    def to_dict(self) -> dict[str, Any]:
        return {"conversations": self.conversations, "rows": self.rows, "replies": self.replies,
                "reply_tokens": self.reply_tokens, "prompt_tokens": self.prompt_tokens,
                "finish": dict(self.finish), "truncated": self.truncated, "empty_replies": self.empty_replies,
                "ended_early": dict(self.ended_early), "dropped": dict(self.dropped),
                "problems": self.problems[:50]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardCounts":
        c = cls(**{k: d[k] for k in ("conversations", "rows", "replies", "reply_tokens", "prompt_tokens",
                                     "empty_replies")})
        c.finish.update(d["finish"])
        c.ended_early.update(d["ended_early"])
        c.dropped.update(d["dropped"])
        c.problems = list(d.get("problems", []))
        return c


@dataclass
class _Open:
    """A shard whose conversations are being generated."""

    shard: int
    replays: list[Replay]
    counts: ShardCounts
    left: int                        # conversations not finished yet


@dataclass
class _Key:
    shard: _Open
    index: int                       # the conversation's place in its shard


class ShardWork:
    """The `RequestSource` of one process: requests from its shards, shards committed as they finish."""

    def __init__(self, shards: list[int], load: Callable[[int], list], commit: Callable[[int, list, ShardCounts], None],
                 render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], np.ndarray],
                 decode: Callable[[list[int]], str], *,
                 stop_ids: frozenset[int], capacity: int, max_new_tokens: int, seed: int, turns: str):
        self.todo = deque(shards)
        self.load, self.commit, self.render, self.decode = load, commit, render, decode
        self.stop_ids = stop_ids
        self.capacity = capacity
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.turns = turns
        self.ready: deque[Request] = deque()        # follow-up turns
        self.fresh: deque[_Key] = deque()           # conversations not started yet
        self.total = ShardCounts()                  # over the shards this process committed
        self.live = ShardCounts()                   # replies so far, committed or not (progress)
        self.committed: list[int] = []

    # -- RequestSource ---------------------------------------------------------------------------

    def next_request(self) -> Request | None:
        if self.ready:
            return self.ready.popleft()
        while self.fresh or self._open_next():
            req = self._request(self.fresh.popleft())
            if req is not None:
                return req
        return None

    def finished(self, done: Finished) -> None:
        key: _Key = done.request.key
        replay = key.shard.replays[key.index]
        counts = key.shard.counts
        tokens = done.tokens[:-1] if done.finish == STOP else done.tokens
        reply = Reply(self.decode(tokens), len(done.tokens), done.finish)
        replay.add(reply)
        for c in (counts, self.live):
            if replay.ended == "empty":
                c.empty_replies += 1
            else:
                c.replies += 1
                c.reply_tokens += reply.num_tokens
                c.finish[reply.finish] += 1
        if not replay.done:
            req = self._request(key)
            if req is not None:
                self.ready.append(req)
            return
        self._conversation_done(key)

    def exhausted(self) -> bool:
        return not self.ready and not self.fresh and not self.todo

    # -- inside ----------------------------------------------------------------------------------

    def _open_next(self) -> bool:
        if not self.todo:
            return False
        shard = self.todo.popleft()
        replays = [Replay.start(c, self.turns) for c in self.load(shard)]
        op = _Open(shard, replays, ShardCounts(conversations=len(replays)), len(replays))
        if not replays:
            self._commit(op)
        self.fresh.extend(_Key(op, i) for i in range(len(replays)))
        return True

    def _request(self, key: _Key) -> Request | None:
        """The request for the conversation's next reply; None (and the conversation ended) if it cannot run."""
        replay = key.shard.replays[key.index]
        try:
            prompt = self.render(replay.history(), replay.conv.tools)
        except BadRowError as e:  # the chat template refused the conversation
            return self._cannot_run(key, e.bad.reason, e.bad.detail)
        room = self.capacity - len(prompt)
        if room < 1:
            return self._cannot_run(key, CONTEXT, f"prompt of {len(prompt)} tokens, rows hold {self.capacity}")
        key.shard.counts.prompt_tokens += len(prompt)
        return Request(key, prompt, row_seed(self.seed, replay.conv.sample_id, replay.turn),
                       min(self.max_new_tokens, room), LENGTH if self.max_new_tokens <= room else CONTEXT)

    def _cannot_run(self, key: _Key, reason: str, detail: str) -> None:
        replay = key.shard.replays[key.index]
        counts = key.shard.counts
        replay.stop(reason)
        if not replay.replies and len(counts.problems) < MAX_PROBLEMS_KEPT:
            why = PROMPT_TOO_LONG if reason == CONTEXT else reason
            counts.problems.append({"file": replay.conv.file, "row": replay.conv.row, "reason": why, "detail": detail})
        self._conversation_done(key)
        return None

    def _conversation_done(self, key: _Key) -> None:
        op = key.shard
        replay = op.replays[key.index]
        if not replay.replies:
            op.counts.dropped[PROMPT_TOO_LONG if replay.ended == CONTEXT else replay.ended] += 1
        elif replay.ended is not None:
            op.counts.ended_early[replay.ended] += 1
        op.left -= 1
        self.live.conversations += 1  # here: conversations finished
        if op.left == 0:
            self._commit(op)

    def _commit(self, op: _Open) -> None:
        rows = [row for r in op.replays if (row := r.output_row()) is not None]
        op.counts.rows = len(rows)
        self.commit(op.shard, rows, op.counts)
        self.total.add(op.counts)
        self.committed.append(op.shard)
        op.replays = []  # the shard's conversations are on disk now
