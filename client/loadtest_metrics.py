"""The load test's reading of the server's /metrics: a scrape as a flat dict, and the figures of a run from two
scrapes (the first and the last) and the peak one. client/loadtest.py uses them, and re-exports them for the
benchmarks and tests that import them from there."""

from __future__ import annotations

import urllib.error
import urllib.request
from urllib.parse import urlsplit


def scrape_metrics(url: str, timeout_s: float = 2.0, token: str | None = None,
                   ssl_context=None) -> dict[str, float] | None:
    """The server's /metrics as {name{labels}: value}, or None when it does not answer.

    Labels are sorted and written ``k=v`` without quotes; a histogram bucket's ``le`` is written as
    Python's ``repr(float(le))``, e.g. ``streamsvc_chunk_latency_seconds_bucket{le=1.0}`` (see ``bucket_key``).
    """
    from prometheus_client.parser import text_string_to_metric_families

    # with tokens the server's /metrics wants one (as a Bearer header); an https URL may need ssl_context
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=ssl_context) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError, TimeoutError):
        return None
    out = {}
    across: dict[str, float] = {}  # a cluster gateway's per-replica samples, summed over replicas (max of maxima)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: (repr(float(v)) if k == "le" else v) for k, v in s.labels.items()}
            joined = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            out[f"{s.name}{{{joined}}}" if joined else s.name] = s.value
            if "replica" in labels:
                rest = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "replica")
                key = f"{s.name}{{{rest}}}" if rest else s.name
                peak = s.name.endswith(("_max_seconds", "_scheduler_load", "_scheduler_pressure"))
                across[key] = max(across.get(key, s.value), s.value) if peak else across.get(key, 0.0) + s.value
    for key, value in across.items():
        out.setdefault(key, value)
    return out


def bucket_key(histogram: str, le: float) -> str:
    """The ``scrape_metrics`` key of a (label-less) histogram's cumulative bucket ``le``."""
    return f"{histogram}_bucket{{le={float(le)!r}}}"


def metrics_url(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    scheme = "https" if parts.scheme == "wss" else "http"
    return f"{scheme}://{parts.netloc}/metrics"


def server_figures(first: dict | None, last: dict | None, wall_s: float, peak: dict | None) -> dict | None:
    """A few server figures over the run: forward costs (wall and device), engine busy fraction, output
    stage cost, chunk latency, stalls. Counters are deltas between the first and the last scrape, except
    ``chunk_latency_max_s``: the server's slowest chunk since it started (the last scrape's value)."""
    if last is None:
        return None
    first = first or {}

    def delta(key: str) -> float:
        return last.get(key, 0.0) - first.get(key, 0.0)

    kinds = ("recache", "denoise", "commit")
    forwards = {k: delta(f"streamsvc_forwards{{kind={k}}}") for k in kinds}
    seconds = {k: delta(f"streamsvc_forward_seconds{{kind={k}}}") for k in kinds}
    gpu_seconds = {k: delta(f"streamsvc_forward_gpu_seconds{{kind={k}}}") for k in kinds}
    chunks_n = delta("streamsvc_chunk_latency_seconds_count")
    encoded_n = delta("streamsvc_chunks_encoded")
    le_1s = bucket_key("streamsvc_chunk_latency_seconds", 1.0)
    ttff_n = delta("streamsvc_ttff_seconds_count")
    return {
        "admitted": delta("streamsvc_streams_admitted_total"),
        "refused": delta("streamsvc_streams_refused_total"),
        "chunks": delta("streamsvc_chunks_total"),  # sent: a chunk fanned out to watchers counts once per viewer
        "chunks_encoded": encoded_n,  # generated: once per stream however many watch it
        "forward_ms": {k: round(1e3 * seconds[k] / forwards[k], 3) if forwards[k] else None for k in kinds},
        "gpu_ms": {k: round(1e3 * gpu_seconds[k] / forwards[k], 3) if forwards[k] else None for k in kinds},
        "encode_ms_per_chunk": round(1e3 * delta("streamsvc_encode_seconds") / encoded_n, 3) if encoded_n else None,
        "forwards": forwards,
        # device time: with forwards launched ahead, launch-to-finish wall times overlap
        "engine_busy": round(sum((gpu_seconds if any(gpu_seconds.values()) else seconds).values()) / wall_s, 4)
        if wall_s > 0 else None,
        "chunk_latency_mean_s": round(delta("streamsvc_chunk_latency_seconds_sum") / chunks_n, 4) if chunks_n else None,
        "chunk_latency_max_s": last.get("streamsvc_chunk_latency_max_seconds"),
        "chunks_over_1s": chunks_n - delta(le_1s) if le_1s in last else None,
        "server_ttff_mean_s": round(delta("streamsvc_ttff_seconds_sum") / ttff_n, 4) if ttff_n else None,
        "client_stalls": delta("streamsvc_client_stalls_total"),
        "webrtc_track_stalls": delta("streamsvc_webrtc_track_stalls_total"),
        "degraded_chunks": {stage: delta(f"streamsvc_degraded_chunks{{stage={stage}}}") for stage in ("device", "encode")},
        "overloaded": delta("streamsvc_streams_overloaded_total"),
        "pressure_peak": None if peak is None else peak.get("streamsvc_scheduler_pressure"),
        "modelled_stalls_peak": None if peak is None else peak.get("streamsvc_modelled_stalls"),
        "scheduler_load_peak": None if peak is None else peak.get("streamsvc_scheduler_load"),
        "kv_bytes_peak": None if peak is None else peak.get("streamsvc_kv_bytes"),
        "open_streams_peak": None if peak is None else sum(
            v for k, v in peak.items() if k.startswith("streamsvc_streams{") and k != "streamsvc_streams{state=closed}"),
        "watchers_peak": None if peak is None else peak.get("streamsvc_watchers"),
        "kv_budget_bytes": last.get("streamsvc_kv_budget_bytes"),
    }
