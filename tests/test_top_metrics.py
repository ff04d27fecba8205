"""`wcache top` against vLLM-format /metrics: prefix hit rates per interval across counter resets, "off" for
what vLLM does not export, and the scripting modes (`--once --json`, `--json --count N`) with their schema.

The /metrics text below follows vLLM's PrometheusStatLogger as prometheus-client writes it: counters carry
`_total` and a `_created` sample, one series per DP engine (`engine` label), `model_name` on every series.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import HEAVY, loaded_of, modules_after_cli, wcache_in_process
from wcache.ipc.http.server import PROMETHEUS_TEXT, QuietHandler, make_http_server
from wcache.monitor.collector import Collector
from wcache.monitor.snapshot import SCHEMA

# prometheus-client's creation time of a counter, as it writes it: scenery, the same for every counter here.
CREATED = "1.7949504001234567e+09"


def _family(name: str, kind: str, help_text: str, values: Sequence[float | str]) -> str:
    """One metric as prometheus-client writes it: HELP, TYPE, then a series per DP engine (`engine` label)."""
    series = [f'{name}{{engine="{engine}",model_name="m"}} {value}' for engine, value in enumerate(values)]
    return "\n".join([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *series]) + "\n"


def _counter(name: str, help_text: str, values: Sequence[float]) -> str:
    """A counter: its `_total` series, and the `_created` gauge prometheus-client writes beside it."""
    return (_family(f"{name}_total", "counter", help_text, values)
            + _family(f"{name}_created", "gauge", help_text, [CREATED] * len(values)))


TTFT_HISTOGRAM = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 20.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 20.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1.7949504001234567e+09
"""


def vllm_text(q0: float, h0: float, q1: float, h1: float) -> str:
    """Two DP engines' /metrics. Per engine: prefix-cache queries and hits (tokens); everything else is scenery."""
    queries, hits = (float(q0), float(q1)), (float(h0), float(h1))
    return "".join([
        _family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", (3.0, 1.0)),
        _family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", (0.0, 0.0)),
        _family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", (0.4125, 0.0871)),
        _counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
        _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits),
        _family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
                (0.0, 0.0)),
        _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", queries),
        TTFT_HISTOGRAM,
    ])


DEPRECATED_METRICS = """\
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{engine="0",model_name="old"}} {q0}
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{{engine="0",model_name="old"}} {h0}
"""

NO_PREFIX_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


class MetricsServer:
    """A local /metrics endpoint; `text` is what the next scrape gets (or `next_text()` is called per scrape)."""

    def __init__(self) -> None:
        self.text = ""
        self.scrapes = 0
        self.next_text: Any = None
        owner = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                owner.scrapes += 1
                text = owner.next_text() if owner.next_text is not None else owner.text
                self.send_body(200, PROMETHEUS_TEXT, text.encode())

        self.httpd = make_http_server("127.0.0.1", 0, Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> MetricsServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@contextmanager
def collector_for(tmp_path: Path, *urls: str) -> Iterator[Collector]:
    empty = tmp_path / "run"
    empty.mkdir(mode=0o700, exist_ok=True)
    collector = Collector(empty, scrape=list(urls), interval_s=0.2)
    try:
        yield collector
    finally:
        collector.close()


# -- hit rates ------------------------------------------------------------------------------------------------


def test_prefix_hit_rate_per_interval_across_a_counter_reset(tmp_path: Path) -> None:
    with MetricsServer() as server, collector_for(tmp_path, server.url) as collector:
        server.text = vllm_text(1000, 400, 500, 100)
        first = collector.poll().engines[0]
        assert first.hit_rate_interval is None  # one sample: no interval yet
        assert first.prefix_queries_total == 1500 and first.prefix_hits_total == 500
        assert first.hit_rate_overall == pytest.approx(500 / 1500)
        assert first.model == "m" and first.kind == "vllm"

        server.text = vllm_text(1600, 850, 900, 250)  # +600/+450 on engine 0, +400/+150 on engine 1
        second = collector.poll().engines[0]
        assert second.hit_rate_interval == pytest.approx(600 / 1000)
        assert second.hit_rate_overall == pytest.approx(1100 / 2500)

        server.text = vllm_text(120, 30, 80, 50)  # the server restarted: both engines count from zero again
        third = collector.poll().engines[0]
        assert third.hit_rate_interval == pytest.approx(80 / 200)  # the new counts, not a negative delta
        assert third.hit_rate_overall == pytest.approx(80 / 200)
        assert third.hit_rate_history == pytest.approx((0.6, 0.4))

        server.text = vllm_text(420, 180, 180, 50)  # and deltas continue from the reset values
        assert collector.poll().engines[0].hit_rate_interval == pytest.approx(150 / 400)


def test_one_dp_engine_resetting_does_not_distort_the_other(tmp_path: Path) -> None:
    with MetricsServer() as server, collector_for(tmp_path, server.url) as collector:
        server.text = vllm_text(1600, 850, 900, 250)
        collector.poll()
        # Engine 0 advances by 400 queries / 300 hits; engine 1 restarted and has 100 / 20 since.
        server.text = vllm_text(2000, 1150, 100, 20)
        row = collector.poll().engines[0]
        assert row.hit_rate_interval == pytest.approx((300 + 20) / (400 + 100))


def test_idle_interval_has_no_rate_and_absent_series_are_off(tmp_path: Path) -> None:
    with MetricsServer() as busy, MetricsServer() as bare, collector_for(tmp_path, busy.url, bare.url) as c:
        busy.text = vllm_text(1000, 400, 500, 100)
        bare.text = NO_PREFIX_METRICS
        c.poll()
        snapshot = c.poll()  # nothing queried in between
        idle, off = snapshot.engines
        assert idle.hit_rate_interval is None and idle.hit_rate_overall == pytest.approx(1 / 3)
        assert idle.hit_rate_history == ()
        assert off.up and off.prefix_queries_total is None and off.hit_rate_overall is None
        for row in (idle, off):
            # vLLM exports no replay counters: absent, not zero.
            assert row.adopted_hits_total is None
            assert row.replayed_tokens_total is None
            assert row.prefill_saved_total is None
            assert row.swa_cached_bytes is None
            assert row.weights is None and row.mode is None and row.attach_ms is None
        engines = snapshot.to_json()["engines"]
        assert engines[0]["replayed_tokens_total"] is None and engines[0]["prefix_queries_total"] == 1500


def test_deprecated_gpu_prefix_cache_names_still_give_rates(tmp_path: Path) -> None:
    with MetricsServer() as server, collector_for(tmp_path, server.url) as collector:
        server.text = DEPRECATED_METRICS.format(q0=100.0, h0=10.0)
        collector.poll()
        server.text = DEPRECATED_METRICS.format(q0=300.0, h0=110.0)
        row = collector.poll().engines[0]
        assert row.hit_rate_interval == pytest.approx(0.5)
        assert row.model == "old"


def test_unreachable_and_non_prometheus_endpoints_are_off_not_errors(tmp_path: Path) -> None:
    with MetricsServer() as garbage:
        garbage.text = "<html><body>502 Bad Gateway</body></html>"
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        with collector_for(tmp_path, garbage.url, dead) as collector:
            for _ in range(2):
                bad, gone = collector.poll().engines
        assert bad.up and bad.prefix_queries_total is None and bad.hit_rate_interval is None
        assert not gone.up and gone.prefix_queries_total is None and gone.model == "?"


# -- scripting modes ------------------------------------------------------------------------------------------

NUMBER = (int, float)
DAEMON_SCHEMA: dict[str, tuple[Any, ...]] = {
    "name": (str,), "pid": (int,), "device": (str,), "tp_rank": (int,), "tp_size": (int,), "model": (str,),
    "key_id": (str,), "state": (str,), "weights_bytes": (int,), "leases": (int,), "uptime_s": (*NUMBER, None),
    "health_status": (int, None), "alive": (bool,),
}
ENGINE_SCHEMA: dict[str, tuple[Any, ...]] = {
    "id": (str,), "url": (str,), "kind": (str,), "model": (str,), "up": (bool,), "weights": (str, None),
    "mode": (str, None), "daemon": (str, None), "attach_ms": (*NUMBER, None),
    **{name: (*NUMBER, None) for name in (
        "prefix_queries_total", "prefix_hits_total", "hit_rate_interval", "hit_rate_overall",
        "adopted_hits_total", "replayed_tokens_total", "prefill_saved_total", "swa_cached_bytes",
        "requests_running", "requests_done", "kv_usage")},
    "reason": (str, None),
    "hit_rate_history": (list,), "key_id": (str, None), "hit_rate_by_weights": (list,), "follows": (bool,),
}
EVENT_SCHEMA: dict[str, tuple[Any, ...]] = {
    "ts": NUMBER, "kind": (str,), "severity": (str,), "summary": (str,), "detail": (dict,),
}
SERVER_SCHEMA: dict[str, tuple[Any, ...]] = {
    "launcher_pid": (int,), "url": (str,), "model": (str,), "state": (str,), "pid": (int, type(None)),
    "restarts": (int,), "last_ready_s": (*NUMBER, type(None)), "last_exit": (str, type(None)),
}


def check_fields(record: dict[str, Any], schema: dict[str, tuple[Any, ...]], where: str) -> None:
    assert set(record) == set(schema), f"{where}: fields {sorted(record)} != {sorted(schema)}"
    for name, allowed in schema.items():
        value = record[name]
        if value is None:
            assert None in allowed, f"{where}.{name} is null"
            continue
        types = tuple(t for t in allowed if t is not None)
        assert isinstance(value, types), f"{where}.{name} = {value!r} is not {types}"
        if isinstance(value, bool):
            assert bool in types, f"{where}.{name} is a bool, not a number"
        if isinstance(value, float):
            assert math.isfinite(value), f"{where}.{name} = {value!r}"


def check_schema(document: dict[str, Any]) -> None:
    """The documented `wcache.top/1` schema (wcache.monitor.snapshot), numbers as JSON numbers."""
    assert document["schema"] == SCHEMA
    assert set(document) == {"schema", "taken_at", "interval_s", "rates", "run_dir", "daemons", "engines", "events",
                             "alerts", "servers"}
    assert isinstance(document["taken_at"], float) and isinstance(document["interval_s"], NUMBER)
    assert document["rates"] in ("interval", "cumulative")
    for i, d in enumerate(document["daemons"]):
        check_fields(d, DAEMON_SCHEMA, f"daemons[{i}]")
    for i, e in enumerate(document["engines"]):
        check_fields(e, ENGINE_SCHEMA, f"engines[{i}]")
        assert e["kind"] in ("wcache", "vllm")
        assert all(isinstance(v, float) and 0 <= v <= 1 for v in e["hit_rate_history"])
        for rate in ("hit_rate_interval", "hit_rate_overall"):
            assert e[rate] is None or 0 <= e[rate] <= 1
    for i, server in enumerate(document["servers"]):
        check_fields(server, SERVER_SCHEMA, f"servers[{i}]")
        assert server["state"] in ("starting", "serving", "backing off", "stopping")
    for i, ev in enumerate(document["events"]):
        check_fields(ev, EVENT_SCHEMA, f"events[{i}]")
        assert ev["severity"] in ("info", "warning", "error")


def ticking(server: MetricsServer) -> None:
    """Each scrape sees 100 more queried tokens per engine, 60 of them hits on engine 0 and 20 on engine 1."""
    step = iter(range(1_000_000))

    def next_text() -> str:
        n = next(step)
        return vllm_text(1000 + 100 * n, 400 + 60 * n, 500 + 100 * n, 100 + 20 * n)

    server.next_text = next_text


def test_once_json_waits_one_interval_and_follows_the_schema(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with MetricsServer() as server:
        ticking(server)
        result = wcache_in_process("top", "--once", "--json", "--scrape", server.url, "--run-dir", str(empty),
                                   "--interval", "0.2")
        assert result.returncode == 0, result.stderr
        assert server.scrapes == 2  # two samples, one interval apart
    document = json.loads(result.stdout)
    check_schema(document)
    assert document["rates"] == "interval" and document["interval_s"] == 0.2
    assert document["run_dir"] == str(empty) and document["daemons"] == [] and document["events"] == []
    [engine] = document["engines"]
    assert engine["id"] == server.url and engine["kind"] == "vllm" and engine["model"] == "m" and engine["up"]
    assert engine["hit_rate_interval"] == pytest.approx(80 / 200)
    assert engine["prefix_queries_total"] == 1700.0
    for name in ("adopted_hits_total", "replayed_tokens_total", "prefill_saved_total", "swa_cached_bytes"):
        assert engine[name] is None, name


def test_json_stream_prints_count_lines_one_per_interval(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with MetricsServer() as server:
        ticking(server)
        result = wcache_in_process("top", "--json", "--count", "3", "--scrape", server.url, "--run-dir",
                                   str(empty), "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    documents = [json.loads(line) for line in lines]
    for document in documents:
        check_schema(document)
        assert document["rates"] == "interval"
        assert document["engines"][0]["hit_rate_interval"] == pytest.approx(0.4)
    assert [len(d["engines"][0]["hit_rate_history"]) for d in documents] == [1, 2, 3]
    assert documents[0]["taken_at"] < documents[1]["taken_at"] < documents[2]["taken_at"]


def test_once_tables_say_off_and_how_rates_were_measured(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    with MetricsServer() as server:
        ticking(server)
        result = wcache_in_process("top", "--once", "--scrape", server.url, "--run-dir", str(empty),
                                   "--interval", "0.2", env={"NO_COLOR": "1", "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "Replay and prefix cache" in text and "40.0 %" in text
    assert "waited between two samples" in text and "0.2 s" in text
    row = next(line for line in text.splitlines() if line.startswith("│ 127.0.0.1:") and "40.0 %" in line)
    # the replay table's row; adopted, replayed, prefill saved and hit % by weights: vLLM does not export them
    assert row.count(" off ") == 4


def test_bad_option_combinations_exit_2(tmp_path: Path) -> None:
    for args in (["--count", "2"], ["--once", "--json", "--count", "2"]):
        result = wcache_in_process("top", *args, "--run-dir", str(tmp_path))
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "--count" in result.stderr
    result = wcache_in_process("top", "--run-dir", str(tmp_path))  # stdin/stdout are pipes here
    assert result.returncode == 2
    assert "needs a terminal" in result.stderr and "--once" in result.stderr


def test_scripting_modes_never_import_textual(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    result, modules = modules_after_cli(probe, "top", "--once", "--json", "--interval", "0.1", "--run-dir",
                                        str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert loaded_of(modules, HEAVY) == []
    check_schema(json.loads(result.stdout))
