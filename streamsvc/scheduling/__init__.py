"""Which stream's forward runs next: a pure, playback-aware scheduler.

No asyncio, no torch, no threads, no clock: every call that depends on time takes
`now` (float seconds, any monotonic origin), so the scheduler is tested by feeding
it events and asserting exact plans (sans-I/O, like vLLM's `schedule()` /
`update_from_output()`).

The unit of work is one forward. A chunk is `denoise_steps` DENOISE forwards
(steps 0..n-1) and one COMMIT forward (which writes the chunk's K/V and decodes
it). A new prompt adds one RECACHE forward before the next chunk of a stream whose
cache already holds committed frames. The engine drives it:

    plan = sched.next(now)                  # None: nothing to start; sleep until wake_at() or an event
    ... launch the forward(s) of `plan`, each stream under plan.prompt_seqs[i] ...
    sched.complete(plan, now, None, deliver=False)  # the state advances; the cost is not known yet
    ... later, from the forward's CUDA events:  sched.observe_cost(plan.kind, len(plan.stream_ids), seconds)
    ... a COMMIT's frames reach the transports: sched.delivered(stream_id, now)

(`complete(plan, now, elapsed_s)` with the default deliver=True does all three at
once, for a caller that runs a forward to its end before deciding the next one.)
A committed chunk not yet delivered is in flight: its frames count toward the
start rule, the cap and the slack as if buffered, but the viewer's buffer model
is credited only by `delivered`.

The package, each module depending only on those above it in this list:

    `config`    SchedulerConfig (every knob, validated) and POLICIES
    `types`     the shared types: Plan, StreamRequest, Admission, stats, Stage, ... (WorkKind: models.work)
    `playback`  PlaybackModel: one viewer's buffer, and when it stalls
    `costs`     CostModel, CostEstimates: forwards', chunks' and stages' costs; SendSampler, without_streamless:
                samples rid of the work of clients without a stream
    `stream`    ScheduledStream: one stream's state (and NextWork, the view of its next forward)
    `admission` AdmissionControl: every refusal rule and its reason text
    `overload`  OverloadMonitor: lateness, stalls, and the last resort (`overloaded`)
    `ranking`   which runnable stream goes first (slack, the stall guard, the policies)
    `planner`   Planner: the start rule, prompts, degrading, parking; next() and complete()
    `scheduler` Scheduler: the registry of streams, composing the parts (the engine's one object)
"""

from .admission import AdmissionControl
from .config import POLICIES, SchedulerConfig
from .costs import RECACHE_WINDOW_S, CostEstimates, CostModel, SendSampler, without_streamless
from .overload import OverloadMonitor
from .playback import PlaybackModel
from .scheduler import Scheduler
from .types import (
    RECACHE_STAGE,
    Admission,
    Late,
    Plan,
    SchedulerError,
    SchedulerStats,
    Stage,
    StreamLoad,
    StreamRequest,
    StreamStats,
)

__all__ = [
    "POLICIES",
    "RECACHE_STAGE",
    "RECACHE_WINDOW_S",
    "Admission",
    "AdmissionControl",
    "CostEstimates",
    "CostModel",
    "Late",
    "OverloadMonitor",
    "Plan",
    "PlaybackModel",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "SendSampler",
    "Stage",
    "StreamLoad",
    "StreamRequest",
    "StreamStats",
    "without_streamless",
]
