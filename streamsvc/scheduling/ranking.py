"""The ranking: among the streams that may start a forward now, which goes first.

Slack = time until the buffer (in flight included) runs dry - estimated time of the
forwards the stream's next chunk still needs (a pending RECACHE included). Ranking,
smallest key first, among runnable streams:

1. Streams about to stall (slack under `stall_guard_chunks` chunks of work) go
   before streams that are only working ahead, whatever the policy, and among
   them a chunk in progress goes first and keeps the device until committed, the
   one with the fewest forwards left first (two streams near empty that alternate
   forwards both deliver late). Admission bounds the average load; this guard is
   what turns that into no stalls during transients (two viewers joining at once,
   a burst of prompts), for every policy.
2. Among the others, with `chunk_granular`, a due chunk in progress (its stream at
   or under its lead) goes first too, again the fewest forwards left first:
   finishing one chunk before starting another lowers the average chunk latency,
   and the engine pays a KV-cache copy each time it switches streams. A chunk
   running ahead (steering to a new prompt, above its lead) keeps no such
   precedence: it has time to spare, a due stream may not.
3. Within each group, the policy (`SchedulerConfig.policy`):
   slack        the default. Streams already late (negative slack: newcomers,
                stalled streams, streams that cannot make it) first, the one with
                the fewest forwards left of its chunk first, so the one closest to
                delivering delivers instead of all of them advancing in lockstep;
                then streams on time, least slack first. A newcomer counts as
                running dry `startup_slack_s` after admission and a stalled stream
                as having run dry when its stall began, so both grow more urgent
                while they wait (a newcomer's first chunk goes ahead of streams
                with a healthy buffer: low TTFF, but not ahead of one about to stall).
   least_slack  the plain rule, a baseline: least slack first, a newcomer's or a
                stalled stream's buffer counting as 0 s.
   round_robin  one forward per stream in turn, in admission order (one chunk per
                stream in turn with `chunk_granular`).
   fifo         the earliest admitted stream first.
"""

from __future__ import annotations

from .config import SchedulerConfig
from .stream import ScheduledStream, NextWork


def rank_key(s: ScheduledStream, work: NextWork, config: SchedulerConfig, guard_s: float, rr_cursor: int) -> tuple:
    """Sort key of stream `s` about to run `work`, smallest first: streams about to stall (slack under `guard_s`),
    chunks in progress first; then the rest, with chunk_granular due chunks in progress first; each group in the
    policy's order (round robin: the first stream after the one of admission order `rr_cursor`, served last)."""
    # Chunks in progress that keep the device: the one closest to its COMMIT first, so two of them
    # never alternate forwards (least slack would: each one's slack grows as it advances).
    if config.stall_guard_chunks is not None and work.slack_s < guard_s:
        # Needed work before work-ahead; a chunk in progress keeps the device until it is committed.
        first = work.step > 0
        return (0, not first, work.chunk_forwards_left if first else 0, *_policy_key(s, work, config, rr_cursor))
    # A chunk running ahead (steering above its lead) keeps no precedence over a due one.
    first = config.chunk_granular and work.step > 0 and work.due
    return (1, not first, work.chunk_forwards_left if first else 0, *_policy_key(s, work, config, rr_cursor))


def _policy_key(s: ScheduledStream, work: NextWork, config: SchedulerConfig, rr_cursor: int) -> tuple:
    """The policy's order within a group of the ranking."""
    policy = config.policy
    if policy == "slack":
        if work.slack_s < 0:  # late: the one closest to delivering first
            return (0, work.chunk_forwards_left, work.slack_s, s.order)
        return (1, work.slack_s, s.order)
    if policy == "least_slack":
        return (work.slack_s, s.order)
    if policy == "round_robin":  # the first stream after the last one served, cyclically
        return (s.order <= rr_cursor, s.order)
    return (s.order,)  # fifo
