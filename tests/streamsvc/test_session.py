"""PromptGate: prompts coalesced per chunk, replies in the order of the requests."""

from hypothesis import given, settings
from hypothesis import strategies as st

from streamsvc import protocol as P
from streamsvc.session import PromptGate


def limited(n: int) -> P.Error:
    return P.Error(code=P.ErrorCode.RATE_LIMITED, message=f"limited {n}", request="set_prompt")


def ack(version: int) -> P.Ack:
    return P.Ack(request="set_prompt", prompt_version=version)


def test_fifty_prompts_between_two_chunks_send_two_to_the_engine_the_first_and_the_newest():
    gate = PromptGate()
    sent = [p for p in (f"prompt {i}" for i in range(50)) if gate.submit(p)]
    assert sent == ["prompt 0"]  # at once: nothing went since the last chunk
    assert gate.chunk_done() == "prompt 49"  # only the newest of those that waited
    replies = gate.answered(ack(2))
    assert replies == [ack(2)] * 49  # every waiting request gets the version that carries its successor
    assert gate.chunk_done() is None  # nothing waits: the next chunk opens the gate
    assert gate.submit("prompt 50")


def test_a_refusal_waits_behind_an_owed_ack_and_goes_at_once_otherwise():
    gate = PromptGate()
    assert gate.refuse(limited(0)) == [limited(0)]
    assert gate.submit("a")
    assert gate.refuse(limited(1)) == [limited(1)]  # "a" was answered already (the server sends its ack)
    assert not gate.submit("b")
    assert gate.refuse(limited(2)) == []
    assert not gate.submit("c")
    assert gate.refuse(limited(3)) == []
    assert gate.chunk_done() == "c"
    assert gate.answered(ack(2)) == [ack(2), limited(2), ack(2), limited(3)]
    assert gate.refuse(limited(4)) == [limited(4)]


def test_a_failed_prompt_fails_every_request_that_waited_for_it():
    gate = PromptGate()
    gate.submit("a")
    gate.submit("b")
    gate.submit("c")
    assert gate.chunk_done() == "c"
    failed = P.Error(code=P.ErrorCode.INTERNAL, message="set_prompt failed: boom", request="set_prompt")
    assert gate.answered(failed) == [failed, failed]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["prompt", "refused", "chunk"]), max_size=80))
def test_one_prompt_per_chunk_reaches_the_engine_and_every_request_is_answered_in_order(events):
    """Simulates the server: requests are numbered, replies must come out numbered in order, once each."""
    gate, out, version, engine_prompts, chunks = PromptGate(), [], 0, 0, 0
    for n, event in enumerate(events):
        if event == "prompt":
            if gate.submit(f"p{n}"):
                version, engine_prompts = version + 1, engine_prompts + 1
                out.append(("ack", n))
        elif event == "refused":
            out += [("error", int(e.message.split()[1])) for e in gate.refuse(limited(n))]
        else:
            chunks += 1
            prompt = gate.chunk_done()
            if prompt is not None:
                version, engine_prompts = version + 1, engine_prompts + 1
                waiting = [m for m, e in enumerate(events[:n]) if e != "chunk" and all(m != k for _, k in out)]
                replies = gate.answered(ack(version))
                out += [("ack" if r.type == "ack" else "error", m) for r, m in zip(replies, waiting)]
                assert prompt == f"p{max(m for m in waiting if events[m] == 'prompt')}"  # the newest
    assert engine_prompts <= chunks + 1
    answered = [m for _, m in out]
    assert answered == sorted(answered) and len(set(answered)) == len(answered)
    owed = [n for n, e in enumerate(events) if e != "chunk" and n not in set(answered)]
    assert owed == [] or (gate.waiting is not None and min(owed) > max(answered, default=-1))
