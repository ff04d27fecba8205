"""Collect one snapshot: daemons from the run dir, engines from their /metrics, events from the log's tail.

All network and socket calls of one poll run concurrently on a small persistent pool with short timeouts, so
a hung daemon or engine costs one timeout, not one per row. Nothing here removes or changes files: `top` is
read-only (stale descriptors are shown as gone, not cleaned).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections import deque
from collections.abc import Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wcache.bounded_read import open_regular, read_bounded_fd
from wcache.checkpoint.display_name import display_name
from wcache.ipc.http.client import health_status, http_get
from wcache.ipc.run_dir.directory import DaemonDescriptor, read_descriptors, run_subdir
from wcache.ipc.run_dir.engines import EngineDescriptor, announcer_alive, read_engine_descriptor
from wcache.ipc.run_dir.loading import LoadingRecord, read_loading
from wcache.ipc.run_dir.paths import RunPaths
from wcache.ipc.run_dir.servers import live_server_records
from wcache.ipc.wire import counters as counter_names
from wcache.monitor import event_types as ev
from wcache.monitor.daemon_status import DaemonStatus, collect
from wcache.monitor.event_types import FEED_KINDS
from wcache.monitor.events import events_path, parse_event, rotated_path
from wcache.monitor.prometheus import Samples, by_label, label_value, parse_metrics, total
from wcache.monitor.rates import CounterDeltas, ratio
from wcache.monitor.snapshot import DaemonRow, EngineRow, EventRow, ServerRow, Snapshot
from wcache.plan.spec import plan_summary

TIMEOUT_S = 1.0  # an engine's /metrics and a supervisor's /health (daemons: daemon_status.STATS_TIMEOUT_S)
HISTORY = 60
HEALTH_EVERY_S = 1.9  # at the default 2 s interval every poll asks; at 2 Hz every fourth one does
# vLLM's prefix-cache counters (tokens), newest name first: 0.9 renamed gpu_prefix_cache_* to prefix_cache_*.
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
# The metric families a poll reads; the rest of a /metrics page is skipped before parsing.
FAMILIES = ("vllm:prefix_cache_", "vllm:gpu_prefix_cache_", "vllm:num_requests_", "vllm:kv_cache_usage",
            "vllm:request_success", "wcache:")
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_DONE = "vllm:request_success_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
MAX_EVENTS = 500
# The most of the log one poll reads: MAX_EVENTS events of a few hundred bytes each, with room to spare.
MAX_TAIL_BYTES = 4 << 20
# A fallback storm: this many engines falling back to disk within the window raises a banner in `top`.
STORM_FALLBACKS = 5
STORM_WINDOW_S = 60.0
class EventTail:
    """Reads only what was appended since the last call; starts over if the file is replaced or truncated."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            st = os.lstat(self.path)
        except OSError:  # gone, or a run dir that is no directory: nothing to tail
            return []
        if not stat.S_ISREG(st.st_mode):  # a FIFO, directory or link in its place: nothing to tail, never a hang
            return []
        data = b""
        if st.st_ino != self._inode or st.st_size < self._offset:
            data = self._rest_of_rotated()
            self._inode, self._offset = st.st_ino, 0
        if st.st_size - self._offset > MAX_TAIL_BYTES:
            # Only the newest events are shown: skip to the last MAX_TAIL_BYTES (the first line there is torn).
            data, self._partial, self._offset = b"", b"", st.st_size - MAX_TAIL_BYTES
        if st.st_size > self._offset:
            # Opened again as checked: the path may name a FIFO by now, which must not block open().
            fresh = self._read_from(self.path, self._offset, st.st_size - self._offset, st.st_ino)
            if fresh is None:
                return []
            self._offset += len(fresh)
            data += fresh
        if not data:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for its newline
        events = []
        for line in lines:
            if (event := parse_event(line)) is not None:
                events.append(event)
        return events

    @staticmethod
    def _read_from(path: Path, offset: int, limit: int, inode: int) -> bytes | None:
        """At most `limit` bytes of the regular file at `path` from `offset`, if it is still file `inode`; None
        for anything else (gone, replaced, a FIFO or a device planted there)."""
        try:
            fd = open_regular(path, follow_links=False)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_ino != inode:
                return None
            os.lseek(fd, offset, os.SEEK_SET)
            return read_bounded_fd(fd, limit + 1)[:limit]  # it may have grown since: the rest is read next poll
        except OSError:
            return None
        finally:
            os.close(fd)

    def _rest_of_rotated(self) -> bytes:
        """What was appended to the file we followed after our last read, if it was rotated (else nothing)."""
        partial, self._partial = self._partial, b""
        if self._inode is None:
            return b""
        rest = self._read_from(rotated_path(self.path), self._offset, MAX_TAIL_BYTES, self._inode)
        if not rest:  # replaced or truncated, not rotated (or nothing more was written): start over
            return b""
        # Complete the line the old file ended in; a torn last line is dropped at the boundary.
        return partial + rest + (b"" if rest.endswith(b"\n") else b"\n")


# The kinds whose one line is their fields in a sentence: (severity, template, fields' stand-ins when absent);
# a field neither the event nor the stand-ins have reads "?".
_TEMPLATES: dict[str, tuple[str, str, dict[str, str]]] = {
    ev.AttachMiss.KIND: ("warning", "miss on {device}: {reason}", {"reason": "no reason recorded"}),
    ev.Fallback.KIND: ("warning", "fell back to disk for {source}: {reason}", {"reason": ""}),
    ev.DaemonLost.KIND: ("error", "engine lost daemon {daemon}", {}),
    ev.EngineWeightsCorrupt.KIND: ("error", "engine {pid} refuses to serve weights daemon {daemon} found changed: "
                                            "{reason}", {"reason": "weights changed in memory"}),
    ev.PreloadFailed.KIND: ("error", "preload of {source} failed: {reason}", {"reason": ""}),
    ev.EngineSwitch.KIND: ("info", "engine {engine_pid} switched {previous_key_id} → {key_id} ({source})", {}),
    ev.SwitchRefused.KIND: ("warning", "engine {engine_pid} refused a switch to {source}: {reason}", {"reason": ""}),
    ev.GroupStopped.KIND: ("error", "TP group of {source} stopped whole: {reason}", {"reason": ""}),
    ev.ScrubFailed.KIND: ("error", "daemon {daemon}: {reason}", {"reason": "weights changed in memory"}),
}


class _Fields(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "?"


def summarize(event: dict[str, Any]) -> EventRow:
    """Severity and a one-line summary; misses, fallbacks and losses stand out, with their reason."""
    kind = event["kind"]
    detail = {k: v for k, v in event.items() if k not in ("ts", "kind")}
    if isinstance(event.get("source"), str):  # the model as people know it in the summary; the path in the detail
        event = {**event, "source": display_name(event["source"])}
    severity = "info"
    if kind in _TEMPLATES:
        severity, template, defaults = _TEMPLATES[kind]
        summary = template.format_map(_Fields({**defaults, **event}))
    elif kind == "daemon_exited":
        severity = "error" if event.get("exit_code") not in (0, None) else "info"
        summary = f"daemon {event.get('daemon', '?')} exited with code {event.get('exit_code')}"
    elif kind == "provenance":
        verdict = event.get("verdict", "?")
        severity = "warning" if verdict == "differs" else "info"
        named = event.get("differs") or []
        which = f": {', '.join(map(str, named))} differ from what was published" if named else ""
        summary = f"provenance of {event.get('daemon', '?')}: {verdict}{which}"
    elif kind == "attach_hit":
        total_ms = _number(_mapping(event.get("timings_ms")).get("total"))
        timing = f", {total_ms:.1f} ms" if total_ms is not None else ""
        summary = f"hit {event.get('daemon', '?')} ({event.get('mode', '?')}{timing})"
        if event.get("verified") is False:
            # --trust-daemon: the checkpoint was never compared with the daemon's, so it may not be the same.
            severity = "warning"
            summary = f"unverified {summary} for {event.get('source', '?')} (the engine trusted the daemon)"
    elif kind == "ready" and event.get("parent_key_id"):
        summary = (f"version {event['parent_key_id']} → {event.get('key_id', '?')} ready in {event.get('daemon', '?')} "
                   f"({event.get('bytes_read', '?')} bytes read)")
    else:
        subject = event.get("daemon") or event.get("source") or ""
        summary = f"{kind.replace('_', ' ')} {subject}".strip()
    return EventRow(ts=float(event.get("ts", 0.0)), kind=kind, severity=severity, summary=summary, detail=detail)


def _mapping(value: Any) -> dict[str, Any]:
    """A field another process wrote that should be an object; anything else reads as empty."""
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """A field that should be a number of milliseconds; anything else (a string, a flag) reads as absent."""
    return float(value) if type(value) in (int, float) else None


def _loading_row(record: LoadingRecord) -> DaemonRow:
    return DaemonRow(
        name=record.name or f"pid {record.pid}", pid=record.pid, device=record.device, tp_rank=record.tp_rank,
        tp_size=record.tp_size, model=display_name(record.source), key_id="-", state="loading", weights_bytes=0,
        leases=0, uptime_s=max(0.0, time.time() - record.started), health_status=None, alive=True,
        loaded_fraction=record.fraction,
    )


def alerts(events: Iterable[EventRow], now: float) -> tuple[str, ...]:
    """What needs a person now: a storm of fallbacks, hits nobody verified."""
    recent = [e for e in events if now - e.ts <= STORM_WINDOW_S]
    found = []
    fallbacks = [e for e in recent if e.kind == "fallback"]
    if len(fallbacks) >= STORM_FALLBACKS:
        last = fallbacks[-1].detail.get("reason") or "no reason recorded"
        found.append(f"FALLBACK STORM: {len(fallbacks)} engines fell back to disk in the last "
                     f"{STORM_WINDOW_S:.0f} s; the latest because {last}")
    # Not limited to the recent window: corrupted weights stay corrupted until the daemon is replaced.
    for event in [e for e in events if e.kind == "scrub_failed"][-3:]:
        found.append(f"CORRUPT WEIGHTS in daemon {event.detail.get('daemon', '?')}: "
                     f"{event.detail.get('reason', 'a tensor changed in memory')}; it refuses new attaches")
    unverified = [e for e in recent if e.kind == "attach_hit" and e.detail.get("verified") is False]
    if unverified:
        found.append(f"{len(unverified)} unverified hit(s) (engines trusting the daemon) in the last "
                     f"{STORM_WINDOW_S:.0f} s: "
                     "those engines never compared their checkpoint with the daemon's")
    return tuple(found)


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """An engine to scrape: announced in the run dir, or named with --scrape."""

    id: str
    url: str
    metrics_url: str | None  # None: nothing to scrape (an offline engine, a TP rank other than 0)
    announced: EngineDescriptor | None
    # Announced by a pid this namespace does not see: an engine in another container sharing the run dir, or
    # one that died without removing its file. Shown only while it answers.
    unseen: bool = False


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


class Collector:
    """Polls everything `wcache top` shows; keeps the previous sample of each counter for rates."""

    def __init__(self, run_dir: Path, scrape: list[str] | None = None, interval_s: float = 2.0) -> None:
        self.run_dir = run_dir
        self.scrape = list(scrape or [])
        self.interval_s = interval_s
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="wcache-top")
        self._tail = EventTail(events_path(run_dir))
        self._events: deque[EventRow] = deque(maxlen=MAX_EVENTS)
        self._deltas = CounterDeltas()
        self._delta_keys: set[Hashable] = set()  # the counter series seen in the current poll
        self._history: dict[str, deque[float]] = {}
        self._health_seen: dict[str, tuple[float, Future[int | None]]] = {}  # url → (when asked, answer)
        self._polls = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- sources -------------------------------------------------------------------------------------

    def _engine_targets(self) -> list[EngineTarget]:
        targets = []
        directory = run_subdir(self.run_dir, RunPaths.ENGINES)
        for path in RunPaths.engine_files(directory) if directory is not None else []:
            try:
                announced = read_engine_descriptor(path)
            except (OSError, ValueError):
                continue
            pid, url = announced.pid, announced.url
            unseen = not announcer_alive(announced)  # another pid namespace's engine is shown while it answers
            # One scrape per server: its TP ranks other than 0 share rank 0's /metrics.
            scraped = metrics_url(url) if url is not None and announced.tp_rank == 0 else None
            if unseen and scraped is None:
                continue  # gone, and nothing could say otherwise
            targets.append(EngineTarget(f"pid {pid}", url or "", scraped, announced, unseen))
        known = {t.metrics_url for t in targets}
        for url in self.scrape:
            if metrics_url(url) not in known:
                targets.append(EngineTarget(url, url, metrics_url(url), None))
        return targets

    @staticmethod
    def _fetch(url: str | None) -> str | None:
        if url is None:
            return None
        status, body = http_get(url, TIMEOUT_S)
        return body.decode("utf-8", errors="replace") if status == 200 and body is not None else None

    @staticmethod
    def _health(url: str) -> int | None:
        return health_status(f"{url}/health", TIMEOUT_S)

    def _health_checks(self, urls: set[str]) -> dict[str, Future[int | None]]:
        """A /health request per supervisor, reusing an answer younger than HEALTH_EVERY_S.

        Daemons answer `stats` on every poll (that is what says alive or gone); their supervisors' HTTP health
        changes rarely, and asking 16 of them at 2 Hz was a third of a poll's CPU.
        """
        now = time.monotonic()
        self._health_seen = {u: seen for u, seen in self._health_seen.items() if u in urls}
        checks = {}
        for url in urls:
            seen = self._health_seen.get(url)
            if seen is None or now - seen[0] >= HEALTH_EVERY_S:
                seen = self._health_seen[url] = (now, self._pool.submit(self._health, url))
            checks[url] = seen[1]
        return checks

    # -- one poll ------------------------------------------------------------------------------------

    def engines(self) -> tuple[EngineRow, ...]:
        """The engines announced in the run dir (and named with --scrape), each server's /metrics scraped once:
        what `wcache status` lists; `poll` does the same beside the daemons."""
        targets = self._engine_targets()
        scraped = {t.id: self._pool.submit(self._fetch, t.metrics_url) for t in targets}
        return self._engine_rows(targets, scraped)

    def _engine_rows(self, targets: list[EngineTarget], scraped: dict[str, Future[str | None]]
                     ) -> tuple[EngineRow, ...]:
        self._delta_keys = set()
        engines = tuple(self._engine_row(t, text) for t in targets
                        if (text := scraped[t.id].result()) is not None or not t.unseen)
        self._deltas.forget(self._delta_keys)  # engines and series that went away start over if they return
        return engines

    def poll(self) -> Snapshot:
        self._polls += 1
        descriptors = read_descriptors(self.run_dir) if self.run_dir.exists() else []
        targets = self._engine_targets()
        health = self._health_checks({d.health_url for d in descriptors if d.health_url})
        scraped: dict[str, Future[str | None]] = {t.id: self._pool.submit(self._fetch, t.metrics_url) for t in targets}
        for event in self._tail.read_new():
            if event["kind"] in FEED_KINDS:
                self._events.append(summarize(event))
        # While the scrapes run on the pool too: one poll waits for the slowest answer, not for their sum.
        stats = collect([d.socket for d in descriptors], self._pool)
        daemons = tuple(self._daemon_row(d, s, health) for d, s in zip(descriptors, stats, strict=True))
        daemons += tuple(_loading_row(r) for r in (read_loading(self.run_dir) if self.run_dir.exists() else []))
        engines = self._engine_rows(targets, scraped)
        return Snapshot(
            taken_at=time.time(), interval_s=self.interval_s,
            rates="interval" if self._polls > 1 else "cumulative", run_dir=str(self.run_dir),
            daemons=daemons, engines=engines, events=tuple(self._events), alerts=alerts(self._events, time.time()),
            servers=server_rows(self.run_dir),
        )

    @staticmethod
    def _daemon_row(d: DaemonDescriptor, answer: DaemonStatus,
                    health: dict[str, Future[int | None]]) -> DaemonRow:
        stats = answer.stats
        status = health[d.health_url].result() if d.health_url in health else None
        counters = stats.counters if stats is not None else {}
        return DaemonRow(
            name=d.name, pid=d.pid, device=d.device, tp_rank=d.tp_rank, tp_size=d.tp_size,
            model=display_name(d.model_source), key_id=d.key_id, plan=plan_summary(d.plan),
            state=("corrupt" if stats.corrupt else stats.state) if stats is not None else "gone",
            weights_bytes=stats.weights_bytes if stats is not None else 0,
            leases=stats.leases if stats is not None else 0,
            uptime_s=stats.uptime_s if stats is not None else None,
            health_status=status if stats is not None else None, alive=stats is not None,
            hits=counters.get("hits", 0),
            misses=sum(counter_names.misses(counters).values()),
            provenance=d.provenance,
            parent_key_id=d.parent_key_id,
        )

    def _delta(self, target: EngineTarget, samples: Samples, names: tuple[str, ...]) -> float | None:
        """Increase of a counter since the last poll, summed over its label sets (one per DP engine).

        Each label set is differenced on its own, so one engine restarting (its counter going back to zero)
        does not hide or inflate the others' increase. None on the first sample or when the series is absent.
        """
        name = next((n for n in names if n in samples), None)
        if name is None:
            return None
        increases = []
        for labels, value in samples[name].items():
            key = (target.id, name, labels)
            self._delta_keys.add(key)
            increase = self._deltas.delta(key, value)
            if increase is not None:
                increases.append(increase)
        return sum(increases) if increases else None

    def _engine_row(self, target: EngineTarget, text: str | None) -> EngineRow:
        samples: Samples = {}
        # Text that is not Prometheus (a proxy's error page, say) leaves every series "off".
        with contextlib.suppress(ValueError):
            samples = parse_metrics(text, FAMILIES) if text is not None else {}
        queries = next((v for n in PREFIX_QUERIES if (v := total(samples, n)) is not None), None)
        hits = next((v for n in PREFIX_HITS if (v := total(samples, n)) is not None), None)
        d_queries = self._delta(target, samples, PREFIX_QUERIES)
        d_hits = self._delta(target, samples, PREFIX_HITS)
        interval_rate = ratio(d_hits, d_queries)
        history = self._history.setdefault(target.id, deque(maxlen=HISTORY))
        if interval_rate is not None:
            history.append(interval_rate)
        announced = target.announced
        attach = announced.attach if announced is not None else None
        if announced is not None:
            weights: str | None = attach.outcome if attach is not None else "disk"
        else:
            weights = label_value(samples, "wcache:engine_weights_info", "outcome")
        if total(samples, "wcache:weights_corrupt_tensors"):  # its daemon found them changed: it refuses to serve
            weights = "corrupt"
        if announced is not None:
            kind = announced.engine
        elif text is None:
            kind = "unreachable"  # a URL given with --scrape that did not answer is no engine we know of
        else:
            kind = "wcache" if "wcache:replayed_tokens_total" in samples else "vllm"
        key_id = ((announced.key_id if announced is not None else None)
                  or label_value(samples, "wcache:engine_weights_info", "key_id") or None)
        return EngineRow(
            id=target.id, url=target.url, kind=kind,
            model=str((announced.model if announced is not None else None)
                      or next((m for n in PREFIX_QUERIES if (m := label_value(samples, n, "model_name"))), None)
                      or "?"),
            up=text is not None if target.metrics_url is not None else not target.unseen, weights=weights,
            reason=attach.reason if attach is not None and attach.outcome != "hit" else None,
            requests_running=total(samples, REQUESTS_RUNNING), requests_done=total(samples, REQUESTS_DONE),
            kv_usage=total(samples, KV_USAGE), mode=attach.mode if attach is not None else None,
            daemon=attach.daemon if attach is not None else None,
            attach_ms=attach.timings_ms.get("total") if attach is not None else None,
            prefix_queries_total=queries, prefix_hits_total=hits,
            hit_rate_interval=interval_rate, hit_rate_overall=ratio(hits, queries),
            adopted_hits_total=total(samples, "wcache:prefix_cache_adopted_hits_total"),
            replayed_tokens_total=total(samples, "wcache:replayed_tokens_total"),
            prefill_saved_total=total(samples, "wcache:prefill_tokens_saved_total"),
            swa_cached_bytes=total(samples, "wcache:swa_cached_bytes"),
            hit_rate_history=tuple(history),
            key_id=key_id, hit_rate_by_weights=_hit_rates_by_weights(samples, key_id),
            follows=announced is not None and announced.follows,
        )


def _hit_rates_by_weights(samples: Samples, current: str | None) -> tuple[tuple[str, float | None], ...]:
    """Each weights key's overall hit rate, the engine's current key first, then by key."""
    queries = by_label(samples, "wcache:prefix_cache_queries_by_weights_total", "weights")
    hits = by_label(samples, "wcache:prefix_cache_hits_by_weights_total", "weights")
    order = sorted(queries, key=lambda key: (key != current, key))
    return tuple((key or "unkeyed", ratio(hits.get(key), queries[key])) for key in order)


def server_rows(run_dir: Path) -> tuple[ServerRow, ...]:
    """The servers running `wcache serve` launchers supervise, from their records (stale ones left out)."""
    if not run_dir.exists():
        return ()
    return tuple(ServerRow(launcher_pid=r.launcher_pid, url=r.url, model=r.model, state=r.state, pid=r.pid,
                           restarts=r.restarts, last_ready_s=r.last_ready_s, last_exit=r.last_exit)
                 for r in live_server_records(run_dir))
