"""`streamsvc serve --help` reads as groups: the basics first, then model and weights, scheduling, WebRTC, access
and limits, recording, the port, cluster; its usage line is short and says the basics."""

from __future__ import annotations

from streamsvc.cli import build_parser


def _serve_help() -> str:
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]
    return sub.format_help()


def test_serve_help_is_grouped_with_the_basics_first():
    text = _serve_help()
    usage, _, rest = text.partition("\n\n")
    assert usage == "usage: streamsvc serve [--host 127.0.0.1] [--port 8000] [--preset tiny] [--device auto] [options]"
    headings = [line.rstrip(":") for line in rest.splitlines() if line and not line.startswith(" ") and
                line.endswith(":")]
    assert headings[:3] == ["options", "basics", "model and weights (see README: Real weights, Fidelity tiers)"]
    assert [h.split(" (")[0].split(":")[0] for h in headings[3:]] == [
        "one stream over several GPUs", "styles per stream", "scheduling", "WebRTC", "access",
        "watchers and recording", "the port", "cluster"]
    basics = rest.split("\nbasics:\n", 1)[1].split("\n\n", 1)[0]
    assert [w for w in basics.split() if w.startswith("--")] == ["--host", "--port", "--preset", "--device"]
