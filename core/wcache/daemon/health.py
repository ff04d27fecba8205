"""The supervisor's HTTP endpoints: /livez, /readyz (and /health, its older name), /metrics (Prometheus text)
and /stats (JSON).

A rank's row is typed once, from its daemon's stats reply (`DaemonStats`) or, when it gives none, its state
(`RankState`); the readiness rules and the metrics read the rows, and msgspec writes them as JSON.

Liveness and readiness differ on purpose: a rank whose weights went to a copy-mode client serves no more
attaches (not ready) but is a healthy process (alive); a liveness probe that failed on it would restart it
in a loop.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wcache.attach_options import MODES
from wcache.checkpoint.file_record import VERDICTS
from wcache.ipc.http.server import JSON_TYPE, HTTPRequestError, QuietHandler, make_http_server
from wcache.ipc.wire import counters as counter_names
from wcache.ipc.wire.messages import DaemonStats
from wcache.monitor.daemon_status import collect
from wcache.schema import Schema

DEAD_STATES = frozenset({"exited", "unreachable"})


class RankState(Schema, frozen=True):
    """A rank that gave no stats: still loading, exited, or not answering (`error` says why)."""

    tp_rank: int
    state: str
    holds_weights: bool
    error: str | None = None


RankRow = DaemonStats | RankState


class RankTable:
    """The ranks a supervisor started, as they become ready; read by every HTTP request."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._lock = threading.Lock()
        self._sockets: dict[int, str] = {}
        self._gone: set[int] = set()

    def ready(self, rank: int, socket_path: str) -> None:
        with self._lock:
            self._sockets[rank] = socket_path

    def gone(self, rank: int) -> None:
        with self._lock:
            self._gone.add(rank)

    def snapshot(self) -> list[RankRow]:
        """Each expected rank's stats, or its state when it cannot answer."""
        with self._lock:
            sockets, gone = dict(self._sockets), set(self._gone)
        asked = [rank for rank in range(self.expected) if rank not in gone and rank in sockets]
        answers = dict(zip(asked, collect([sockets[rank] for rank in asked]), strict=True))
        ranks: list[RankRow] = []
        for rank in range(self.expected):
            answer = answers.get(rank)
            if answer is not None and answer.stats is not None:
                ranks.append(answer.stats.stats())
            elif answer is not None:
                ranks.append(RankState(tp_rank=rank, state=answer.state, holds_weights=False, error=answer.error))
            else:
                ranks.append(RankState(tp_rank=rank, state="exited" if rank in gone else "loading",
                                       holds_weights=False))
        return ranks


def healthy(ranks: list[RankRow]) -> bool:
    """Ready: every rank is ready and holds weights (what /readyz and /health answer 200 to)."""
    return bool(ranks) and all(isinstance(r, DaemonStats) and r.state == "ready" and r.holds_weights
                               and not r.corrupt for r in ranks)


def alive(ranks: list[RankRow]) -> bool:
    """Alive: no rank has exited or stopped answering; loading and released ranks are alive."""
    return bool(ranks) and all(rank_alive(r) for r in ranks)


def rank_alive(rank: RankRow) -> bool:
    return rank.state not in DEAD_STATES


def health_json(ranks: list[RankRow], status: str | None = None) -> bytes:
    """The JSON document of an endpoint: its status (none for /stats) and the rank rows."""
    return msgspec.json.encode({"ranks": ranks} if status is None else {"status": status, "ranks": ranks})


class _StatsCollector(Collector):
    def __init__(self, table: RankTable) -> None:
        self.table = table

    def collect(self) -> Iterator[Metric]:
        ranks = self.table.snapshot()
        labels = ["tp_rank", "key_id"]
        ready = GaugeMetricFamily("wcache_daemon_ready", "1 while the rank is ready and holds weights.", labels=labels)
        live = GaugeMetricFamily("wcache_daemon_alive", "1 while the rank's process runs and answers (loading, "
                                 "ready or released).", labels=labels)
        weights = GaugeMetricFamily("wcache_daemon_weights_bytes", "Bytes of processed weights held.", labels=labels)
        leases = GaugeMetricFamily("wcache_daemon_leases", "Zero-copy engines attached now.", labels=labels)
        attaches = CounterMetricFamily("wcache_attaches", "Maps served.", labels=[*labels, "mode"])
        hits = CounterMetricFamily("wcache_hits", "Hellos whose key matched.", labels=labels)
        unverified = CounterMetricFamily(
            "wcache_unverified_hits", "Hits whose engine trusted the daemon, skipping the checkpoint comparison.",
            labels=labels)
        misses = CounterMetricFamily("wcache_misses", "Hellos whose key did not match, by reason.",
                                     labels=[*labels, "reason"])
        served = CounterMetricFamily("wcache_bytes_served", "Bytes of weights mapped or copied by engines.",
                                     labels=labels)
        bad = CounterMetricFamily("wcache_bad_frames", "Connections dropped for malformed frames.", labels=labels)
        provenance = GaugeMetricFamily(
            "wcache_daemon_provenance", "1 for the verdict on the rank's files against what the Hub published "
            "(matches, differs, unknown), judged at load.", labels=[*labels, "verdict"])
        corrupt = GaugeMetricFamily("wcache_daemon_corrupt_tensors", "Tensors the background re-check found changed "
                                    "in memory (the rank then fails readiness).", labels=labels)
        scrubbed = CounterMetricFamily("wcache_scrub_bytes", "Arena bytes re-hashed by the background check.",
                                       labels=labels)
        passes = CounterMetricFamily("wcache_scrub_passes", "Completed background re-checks of the arena.",
                                     labels=labels)
        for r in ranks:
            stats = r if isinstance(r, DaemonStats) else None
            values = [str(r.tp_rank), stats.key_id if stats else ""]
            counters = stats.counters if stats else {}
            ready.add_metric(values, 1.0 if healthy([r]) else 0.0)
            corrupt.add_metric(values, float(len(stats.corrupt or ()) if stats else 0))
            scrubbed.add_metric(values, float(counters.get("scrub_bytes", 0)))
            passes.add_metric(values, float(counters.get("scrub_passes", 0)))
            live.add_metric(values, 1.0 if rank_alive(r) else 0.0)
            weights.add_metric(values, float(stats.weights_bytes if stats else 0))
            leases.add_metric(values, float(stats.leases if stats else 0))
            for mode in MODES:
                attaches.add_metric([*values, mode], float(counters.get(counter_names.attaches(mode), 0)))
            hits.add_metric(values, float(counters.get("hits", 0)))
            unverified.add_metric(values, float(counters.get("hits_unverified", 0)))
            for reason, count in counter_names.misses(counters).items():
                misses.add_metric([*values, reason], float(count))
            served.add_metric(values, float(counters.get("bytes_served", 0)))
            bad.add_metric(values, float(counters.get("bad_frames", 0)))
            if stats and stats.provenance in VERDICTS:
                for verdict in VERDICTS:
                    provenance.add_metric([*values, verdict], 1.0 if stats.provenance == verdict else 0.0)
        yield from (ready, live, weights, leases, attaches, hits, unverified, misses, served, bad, provenance,
                    corrupt, scrubbed, passes)


def serve_health(table: RankTable, host: str, port: int,
                 flags: tuple[str, str] | None = None) -> ThreadingHTTPServer:
    """Start the endpoints in a background thread; returns the server (its port may have been 0).

    `flags` name the options that chose host and port, for the ListenError raised when it cannot listen.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(table))

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            path = self.route()
            if path in ("/readyz", "/health"):
                ranks = table.snapshot()
                ok = healthy(ranks)
                self.send_body(200 if ok else 503, JSON_TYPE, health_json(ranks, "ok" if ok else "unavailable"))
            elif path == "/livez":
                ranks = table.snapshot()
                ok = alive(ranks)
                self.send_body(200 if ok else 503, JSON_TYPE, health_json(ranks, "ok" if ok else "down"))
            elif path == "/metrics":
                self.send_metrics(registry)
            elif path == "/stats":
                self.send_body(200, JSON_TYPE, health_json(table.snapshot()))
            else:
                raise HTTPRequestError(f"no route {path}; try /livez, /readyz, /metrics or /stats", 404)

    server = make_http_server(host, port, Handler, flags)
    threading.Thread(target=server.serve_forever, name="wcache-health", daemon=True).start()
    return server
