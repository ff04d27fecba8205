"""The deployment recipes in deploy/ and the readiness notification their systemd unit relies on.

Every recipe parses; every `wcache` command line in them (deploy/README.md's included) parses against the
real Click command tree; probes point at routes the server behind their port serves; engines ask for the
run dir, uid, volume and plan their daemon holds. sd_notify is tested with real datagram sockets and a real
foreground `wcache preload` under a NOTIFY_SOCKET.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from daemon_fixtures import daemon_rig, http_status, nothing_survives, wait_for  # noqa: F401
from helpers import WCACHE
from wcache.attach_options import AttachOptions
from wcache.daemon.health import RankTable, serve_health
from wcache.daemon.sd_notify import Notifier
from wcache_cli.app import app

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "wcache-preload@.service"
UNIT_ENV = DEPLOY / "systemd" / "example.env"
SERVE_UNIT = DEPLOY / "systemd" / "wcache-serve@.service"
SERVE_UNIT_ENV = DEPLOY / "systemd" / "example-serve.env"
KUBERNETES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# Recipes of `wcache serve`, which starts the daemons of its server's plan itself: no daemon container to match.
SERVE_RECIPES = [DEPLOY / "kubernetes" / "serve.yaml"]
COMPOSE = DEPLOY / "compose" / "docker-compose.yaml"
README = DEPLOY / "README.md"
ENGINE_SERVER = REPO / "core" / "wcache" / "serving" / "server.py"

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Words that may stand before `wcache` on a command line: what runs it, not arguments of something else
# (`--load-format wcache` is vLLM's argument, not a wcache command).
LAUNCHERS = {"CMD", "CMD-SHELL", "exec", "sudo", "tini", "/usr/bin/tini", "--"}
# A startup allowance shorter than this kills a large checkpoint's daemon mid-load.
MIN_STARTUP_S = 600
# Specifiers the unit uses, as systemd expands them for the instance `qwen3-0.6b` of a system unit.
SPECIFIERS = {"%i": "qwen3-0.6b", "%I": "qwen3-0.6b", "%t": "/run", "%C": "/var/cache", "%%": "%"}
ROOT = typer.main.get_command(app)
PLAN_FIELDS = ("model", "dtype", "quantization", "plan", "tp")


# -- reading the recipes ---------------------------------------------------------------------------------


@dataclass
class Workload:
    """One container or service: its command line, environment, uid, volumes and probes."""

    where: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    uid: str | None = None
    mounts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # mount path -> volume identity
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def wcache(self) -> list[str] | None:
        return wcache_argv(self.argv)


def wcache_argv(words: list[str]) -> list[str] | None:
    """The `wcache ...` command in a list of words, if one starts it (after launchers only)."""
    for i, word in enumerate(words):
        if word == "wcache" or word.endswith("/bin/wcache"):  # not /run/wcache, a directory
            return words[i:]
        if word not in LAUNCHERS:
            return None
    return None


def shell_commands(text: str) -> Iterator[list[str]]:
    """Every `wcache ...` command in shell text: lines joined at backslashes, split at && ; and |."""
    for line in text.replace("\\\n", " ").splitlines():
        stripped = line.strip().removeprefix("$ ")
        if "wcache" not in stripped:
            continue
        try:
            words = shlex.split(stripped, comments=True)
        except ValueError:
            continue
        segment: list[str] = []
        for word in [*words, ";"]:
            if word in {"&&", ";", "|", "||"}:
                found = wcache_argv(segment)
                if found:
                    yield found
                segment = []
            else:
                segment.append(word)


def load_yaml(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kubernetes_workloads(path: Path) -> list[Workload]:
    found = []
    for index, doc in enumerate(load_yaml(path)):
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec") if doc["kind"] != "Pod" else spec
        if pod is None:
            continue
        volumes = {v["name"]: _volume_identity(v, f"{path.name}#{index}") for v in pod.get("volumes", [])}
        pod_uid = pod.get("securityContext", {}).get("runAsUser")
        for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
            uid = container.get("securityContext", {}).get("runAsUser", pod_uid)
            found.append(Workload(
                where=f"{path.name} {doc['kind']}/{doc['metadata']['name']} container {container['name']}",
                argv=[str(w) for w in [*container.get("command", []), *container.get("args", [])]],
                env={e["name"]: str(e.get("value", "")) for e in container.get("env", [])},
                uid=None if uid is None else str(uid),
                mounts={m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])},
                probes={k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container},
                ports={p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p},
                raw={"kind": doc["kind"], **container},
            ))
    return found


def _volume_identity(volume: dict[str, Any], pod: str) -> tuple[str, ...]:
    """Two mounts share files when these are equal: an emptyDir is its Pod's, a hostPath is the node's path."""
    if "hostPath" in volume:
        return ("hostPath", volume["hostPath"]["path"])
    if "persistentVolumeClaim" in volume:
        return ("pvc", volume["persistentVolumeClaim"]["claimName"])
    return ("pod", pod, volume["name"])


def compose_workloads(path: Path) -> list[Workload]:
    (doc,) = load_yaml(path)
    found = []
    for name, service in doc["services"].items():
        env = service.get("environment", {})
        if isinstance(env, list):
            env = dict(item.split("=", 1) for item in env)
        mounts = {}
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            kind = "volume" if source in doc.get("volumes", {}) else "bind"
            mounts[target] = (kind, source)
        command = service.get("command", [])
        found.append(Workload(
            where=f"{path.name} service {name}",
            argv=[str(w) for w in (shlex.split(command) if isinstance(command, str) else command)],
            env={k: str(v) for k, v in env.items()},
            uid=str(service["user"]).split(":")[0] if "user" in service else None,
            mounts=mounts,
            raw={"name": name, **service},
        ))
    return found


def unit_directives(path: Path) -> list[tuple[str, str]]:
    pairs = []
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            pairs.append((key.strip(), value.strip()))
    return pairs


def env_file(path: Path) -> dict[str, str]:
    return dict(p for p in unit_directives(path))


def unit_exec_argv(value: str, env: dict[str, str]) -> list[str]:
    """An Exec line as systemd runs it: specifiers, then `${X}` as one word and `$X` split on spaces."""
    for spec, replacement in SPECIFIERS.items():
        value = value.replace(spec, replacement)
    words: list[str] = []
    for word in shlex.split(value.lstrip("-@:+!")):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            words.extend(env.get(bare.group(1), "").split())
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def unit_workload(unit: Path = UNIT, unit_env: Path = UNIT_ENV) -> Workload:
    directives = unit_directives(unit)
    env = env_file(unit_env)
    for key, value in directives:
        if key == "Environment":
            name, _, setting = value.partition("=")
            env[name] = unit_exec_argv(setting, {})[0]
    (exec_start,) = [v for k, v in directives if k == "ExecStart"]
    return Workload(where=f"{unit.name} ExecStart", argv=unit_exec_argv(exec_start, env), env=env)


def all_workloads() -> list[Workload]:
    found = [unit_workload(), unit_workload(SERVE_UNIT, SERVE_UNIT_ENV), *compose_workloads(COMPOSE)]
    for path in KUBERNETES:
        found.extend(kubernetes_workloads(path))
    return found


def all_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every wcache command line in every recipe and in the README's code blocks."""
    commands = [(w.where, w.wcache) for w in all_workloads() if w.wcache]
    seen = {tuple(argv) for _, argv in commands}
    for path in [*KUBERNETES, COMPOSE]:
        for doc in load_yaml(path):
            for node in _nodes(doc):  # what no container's command holds: health checks, shell text
                found = [wcache_argv([str(w) for w in node])] if isinstance(node, list) else (
                    list(shell_commands(node)) if isinstance(node, str) and " " in node else [])
                for argv in found:
                    if argv and tuple(argv) not in seen:
                        seen.add(tuple(argv))
                        commands.append((f"{path.name} (elsewhere)", argv))
    for index, block in enumerate(re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), flags=re.S)):
        commands.extend((f"{README.name} code block {index + 1}", argv) for argv in shell_commands(block))
    for key, value in unit_directives(UNIT):
        if key.startswith("Exec") and key != "ExecStart":
            found = wcache_argv(unit_exec_argv(value, unit_workload().env))
            if found:
                commands.append((f"{UNIT.name} {key}", found))
    return commands


def _nodes(node: Any) -> Iterator[Any]:
    """Every value in a YAML document, depth first: mappings, lists and scalars."""
    yield node
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        yield from _nodes(child)


def parse(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """The subcommand and its parameters as the real CLI parses them (Click's own errors when it cannot)."""
    args = argv[1:]
    root = ROOT.make_context("wcache", list(args))
    name, command, rest = ROOT.resolve_command(root, list(args))
    assert name is not None and command is not None
    return name, command.make_context(name, list(rest), parent=root).params


def run_dir_of(workload: Workload, params: dict[str, Any]) -> str | None:
    value = params.get("run_dir") or workload.env.get("WCACHE_RUN_DIR")
    return None if value is None else str(value)


def plan_of(params: dict[str, Any]) -> dict[str, str]:
    return {name: str(getattr(params.get(name), "value", params.get(name))) for name in PLAN_FIELDS}


def option_value(argv: list[str], flag: str) -> str | None:
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


# -- the recipes ---------------------------------------------------------------------------------------------


def test_every_recipe_parses_and_runs_wcache() -> None:
    for path in [*KUBERNETES, COMPOSE]:
        assert load_yaml(path), f"{path} holds no document"
    wheres = {where.split(" ")[0] for where, _ in all_commands()}
    expected = {UNIT.name, SERVE_UNIT.name, COMPOSE.name, README.name, *(p.name for p in KUBERNETES)}
    assert expected <= wheres, f"recipes without any wcache command: {sorted(expected - wheres)}"
    assert {"sidecar.yaml", "daemonset.yaml"} <= {p.name for p in KUBERNETES}


def test_every_wcache_command_parses_against_the_cli() -> None:
    failures = []
    for where, argv in all_commands():
        try:
            parse(argv)
        except Exception as exc:  # Click's UsageError and its kin: one sentence each
            message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
            failures.append(f"{where}: `{shlex.join(argv)}`: {message}")
    assert not failures, "recipe commands the CLI refuses:\n" + "\n".join(failures)


def test_recipes_use_the_probe_and_log_options() -> None:
    """What the recipes are for: an exec check, a log format, liveness and readiness paths."""
    used = {(argv[1], word) for _, argv in all_commands() for word in argv[2:] if word.startswith("--")}
    for pair in [("status", "--check"), ("preload", "--log-format"), ("preload", "--log-level"),
                 ("preload", "--health-port"), ("preload", "--health-host")]:
        assert pair in used, f"no recipe runs `wcache {pair[0]} {pair[1]}`"
    paths = {p["httpGet"]["path"] for w in all_workloads() for p in w.probes.values() if "httpGet" in p}
    assert {"/livez", "/readyz"} <= paths


def test_preload_stays_in_the_foreground_everywhere() -> None:
    """Service managers own the process they start: a detached preload would exit and look like a crash."""
    preloads = [(where, parse(argv)[1]) for where, argv in all_commands() if argv[1] == "preload"]
    assert len(preloads) >= 4
    assert [where for where, params in preloads if params["detach"]] == []


@pytest.mark.parametrize("recipe", KUBERNETES, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_api_schema(recipe: Path) -> None:
    """Strict schema validation for Kubernetes 1.34 (resource.k8s.io/v1), where kubernetes-validate is
    installed (it is not a test dependency: `pip install kubernetes-validate` to run this)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in load_yaml(recipe):
        kubernetes_validate.validate(doc, "1.34.0", strict=True)


@pytest.fixture(scope="module")
def health_serves() -> Iterator[Any]:
    """A real supervisor health server (one rank, still loading): which paths it routes."""
    server = serve_health(RankTable(1), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert http_status(url + "/no-such-route")[0] == 404  # the check below can tell a route from none
        yield lambda path: http_status(url + path)[0] != 404
    finally:
        server.shutdown()
        server.server_close()


def engine_routes() -> set[str]:
    """The GET routes of `wcache attach --serve` (read from its handler)."""
    source = ENGINE_SERVER.read_text()
    handler = source[source.index("def do_GET"):source.index("def do_POST")]
    return set(re.findall(r'path == "(/[^"]*)"', handler))


def test_kubernetes_probes_reach_real_routes_on_the_right_port(health_serves: Any) -> None:
    checked = 0
    for workload in [w for path in KUBERNETES for w in kubernetes_workloads(path)]:
        argv = workload.wcache
        if argv is None or not workload.probes:
            continue
        name, params = parse(argv)
        if name == "preload":
            port, host, routes_ok = params["health_port"], params["health_host"], health_serves
        elif name == "attach" and params["serve"]:
            served = engine_routes()
            port, host, routes_ok = params["port"], params["host"], served.__contains__
        else:
            continue
        assert host not in LOOPBACK, f"{workload.where}: the kubelet cannot probe {host}"
        for kind, probe in workload.probes.items():
            get = probe["httpGet"]
            probe_port = workload.ports.get(get["port"], get["port"])
            assert probe_port == port, f"{workload.where}: {kind} probes port {probe_port}, the server is on {port}"
            assert routes_ok(get["path"]), f"{workload.where}: {kind} path {get['path']} is no route there"
            checked += 1
    assert checked >= 8


def test_kubernetes_daemons_probe_alive_for_liveness_and_ready_for_readiness() -> None:
    daemons = [w for path in KUBERNETES for w in kubernetes_workloads(path) if w.wcache and w.wcache[1] == "preload"]
    assert len(daemons) >= 3
    for workload in daemons:
        probes = workload.probes
        # A daemon released to a copy-mode engine is alive, never ready again: liveness on readiness loops.
        assert probes["livenessProbe"]["httpGet"]["path"] == "/livez", workload.where
        startup = probes["startupProbe"]
        assert startup["httpGet"]["path"] == "/readyz", workload.where
        allowance = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        assert allowance >= MIN_STARTUP_S, f"{workload.where}: {allowance} s to load is too little"
        if "readinessProbe" in probes:
            assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz", workload.where
        if workload.raw["kind"] == "DaemonSet":
            assert "readinessProbe" in probes, f"{workload.where}: a node's daemon should say when it is ready"


def daemons_and_engines(workloads: list[Workload]) -> tuple[list[tuple[Workload, dict[str, Any]]],
                                                            list[tuple[Workload, dict[str, Any]]]]:
    daemons, engines = [], []
    for workload in workloads:
        argv = workload.wcache
        if argv is not None:
            name, params = parse(argv)
            if name == "preload":
                daemons.append((workload, params))
            elif name == "attach" and params["serve"]:
                engines.append((workload, params))
        elif option_value(workload.argv, "--load-format") == "wcache":
            extra = json.loads(option_value(workload.argv, "--model-loader-extra-config") or "{}")
            options = AttachOptions.from_mapping(extra, f"{workload.where} --model-loader-extra-config")
            engines.append((workload, {"model": option_value(workload.argv, "--model"), "vllm": True,
                                       "dtype": option_value(workload.argv, "--dtype"),
                                       "run_dir": options.run_dir}))
    return daemons, engines


@pytest.mark.parametrize("recipe", [*(p for p in KUBERNETES if p not in SERVE_RECIPES), COMPOSE], ids=lambda p: p.name)
def test_engines_ask_for_what_their_daemon_holds(recipe: Path) -> None:
    """Same run dir on the same volume, same uid, same model and plan: anything else is a miss at runtime."""
    workloads = kubernetes_workloads(recipe) if recipe in KUBERNETES else compose_workloads(recipe)
    daemons, engines = daemons_and_engines(workloads)
    assert daemons and engines, f"{recipe.name}: no daemon or no engine"
    for engine, wanted in engines:
        run_dir = run_dir_of(engine, wanted)
        assert run_dir, f"{engine.where}: no run dir (--run-dir or WCACHE_RUN_DIR)"
        matches = []
        for daemon, held in daemons:
            if run_dir_of(daemon, held) != run_dir or str(held["model"]) != str(wanted["model"]):
                continue
            if wanted.get("vllm"):
                same_plan = wanted["dtype"] == str(held["dtype"].value)
            else:
                same_plan = plan_of(held) == plan_of(wanted)
            assert same_plan, f"{engine.where} asks for another plan than {daemon.where} holds"
            assert engine.uid == daemon.uid, f"{engine.where} runs as uid {engine.uid}, its daemon {daemon.uid}"
            assert volume_of(engine, run_dir) == volume_of(daemon, run_dir) is not None, (
                f"{engine.where} and {daemon.where} do not share the volume holding {run_dir}")
            matches.append(daemon)
        assert matches, f"{engine.where}: no daemon in {recipe.name} serves model {wanted['model']} in {run_dir}"


def volume_of(workload: Workload, path: str) -> tuple[str, ...] | None:
    """The volume that holds `path` in this container: the mount with the longest matching prefix."""
    best = max((m for m in workload.mounts if path == m or path.startswith(m.rstrip("/") + "/")), key=len,
               default=None)
    return None if best is None else (best, *workload.mounts[best])


def test_compose_checks_health_with_wcache_status_and_engines_wait_for_it() -> None:
    workloads = compose_workloads(COMPOSE)
    daemons, engines = daemons_and_engines(workloads)
    for daemon, held in daemons:
        check = daemon.raw["healthcheck"]
        assert check["test"][0] == "CMD", "an exec probe, without a shell"
        argv = wcache_argv([str(w) for w in check["test"]])
        assert argv is not None
        name, params = parse(argv)
        assert (name, params["check"]) == ("status", True)
        assert str(params["run_dir"]) == run_dir_of(daemon, held)
        assert compose_seconds(check["start_period"]) >= MIN_STARTUP_S
        for engine, _ in engines:
            assert engine.raw["depends_on"][daemon.raw["name"]]["condition"] == "service_healthy"
            assert engine.raw["ipc"] == f"service:{daemon.raw['name']}"


def compose_seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a Compose duration: {duration}"
    return sum(float(n) * units[u] for n, u in parts)


def test_systemd_unit_is_notify_and_stops_through_the_cli() -> None:
    directives = dict(unit_directives(UNIT))
    assert directives["Type"] == "notify"
    assert directives["NotifyAccess"] == "main"
    # SIGTERM to the CLI alone: it stops the supervisor, which stops the ranks in order.
    assert directives["KillMode"] == "mixed"
    assert directives["EnvironmentFile"] == "/etc/wcache/%i.env"
    name, params = parse(unit_workload().wcache or [])
    assert name == "preload" and not params["detach"]
    assert str(params["model"]) == env_file(UNIT_ENV)["WCACHE_MODEL"]
    assert str(params["run_dir"]) == "/run/wcache"  # RuntimeDirectory=wcache under %t


def test_serve_recipes_probe_the_server_and_leave_restarts_to_the_launcher() -> None:
    """`wcache serve` restarts its server itself, keeping the daemons: a liveness probe on the server would kill
    the launcher and its weights during a restart; readiness is the server's /health on its own port."""
    checked = 0
    for workload in [w for path in SERVE_RECIPES for w in kubernetes_workloads(path)]:
        argv = workload.wcache
        assert argv is not None and parse(argv)[0] == "serve", workload.where
        vllm_args = argv[argv.index("--") + 1:]
        assert option_value(vllm_args, "--host") not in LOOPBACK, f"{workload.where}: the kubelet cannot probe it"
        port = int(option_value(vllm_args, "--port") or 8000)
        assert "livenessProbe" not in workload.probes, workload.where
        for kind in ("startupProbe", "readinessProbe"):
            get = workload.probes[kind]["httpGet"]
            assert get["path"] == "/health" and workload.ports.get(get["port"], get["port"]) == port, workload.where
        startup = workload.probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S, workload.where
        run_dir = str(parse(argv)[1]["run_dir"])
        assert volume_of(workload, run_dir) is not None, f"{workload.where}: {run_dir} is on no volume"
        checked += 1
    assert checked >= 1


def test_systemd_serve_unit_is_notify_reloads_with_sighup_and_stops_through_the_cli() -> None:
    directives = dict(unit_directives(SERVE_UNIT))
    assert (directives["Type"], directives["NotifyAccess"], directives["KillMode"]) == ("notify", "main", "mixed")
    assert directives["ExecReload"] == "/bin/kill -HUP $MAINPID"  # what `wcache restart` sends, and SIGHUP restarts
    assert directives["EnvironmentFile"] == "/etc/wcache/serve-%i.env"
    argv = unit_workload(SERVE_UNIT, SERVE_UNIT_ENV).wcache or []
    name, params = parse(argv)
    assert name == "serve" and str(params["model"]) == env_file(SERVE_UNIT_ENV)["WCACHE_MODEL"]
    assert str(params["run_dir"]) == "/run/wcache"
    assert params["vllm_args"][:4] == ["--host", "127.0.0.1", "--port", "8000"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    """With its installed paths pointed at this checkout (verify checks that ExecStart is executable)."""
    wcache = Path(sys.executable).parent / "wcache"
    assert wcache.exists(), f"{wcache} is missing; install the package into this interpreter's environment"
    text = UNIT.read_text().replace("/opt/wcache/.venv/bin/wcache", str(wcache))
    text = text.replace("/etc/wcache/%i.env", str(UNIT_ENV))
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                            timeout=60)
    # Unknown keys and bad values are only warnings (exit 0): any line about our file is a failure.
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "wcache-preload" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


# -- sd_notify ------------------------------------------------------------------------------------------------


def receive(sock: socket.socket, timeout: float) -> dict[str, str]:
    sock.settimeout(timeout)
    try:
        data = sock.recv(4096).decode()
    except TimeoutError:
        raise AssertionError(f"no notification within {timeout} s") from None
    return dict(line.split("=", 1) for line in data.split("\n"))


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    name = f"wcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield sock, "@" + name


def test_notify_reaches_an_abstract_socket_one_assignment_per_line(abstract_listener: Any) -> None:
    sock, address = abstract_listener
    notifier = Notifier(address)
    assert notifier.ready("two\nlines")
    assert receive(sock, 5) == {"READY": "1", "STATUS": "two lines"}
    assert notifier.stopping()
    assert receive(sock, 5)["STOPPING"] == "1"


def test_notify_takes_the_variable_out_of_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                          abstract_listener: Any) -> None:
    sock, address = abstract_listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    notifier = Notifier.take_from_environment()
    assert "NOTIFY_SOCKET" not in os.environ
    assert notifier.ready("up")
    assert receive(sock, 5)["READY"] == "1"


def test_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier.take_from_environment()
    with caplog.at_level(logging.WARNING, logger="wcache"):
        assert not notifier.ready("up")
        assert not notifier.stopping()
    assert caplog.records == []


def test_a_missing_notify_socket_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier(str(tmp_path / "gone.sock"))
    with caplog.at_level(logging.WARNING, logger="wcache"):
        assert not notifier.ready("up")
        assert not notifier.stopping()
        assert not notifier.ready("again")
    assert len(caplog.records) == 1
    assert "gone.sock" in caplog.records[0].getMessage()


def environ_of(pid: int) -> set[str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return {entry.split(b"=", 1)[0].decode() for entry in raw.split(b"\0") if entry}


def test_foreground_preload_notifies_ready_once_served_then_stopping_on_sigterm(tiny_template: Path) -> None:
    with daemon_rig() as rig, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        address = str(rig.base / "notify.sock")
        sock.bind(address)
        # A file, not a pipe: the ranks inherit the preload's stderr, and a pipe they hold open would block
        # reading it to its end for as long as they live.
        output = rig.base / "preload.out"
        with output.open("w") as sink:
            process = subprocess.Popen(
                [*WCACHE, "preload", str(tiny_template), "--run-dir",
                 str(rig.run_dir)],
                env={**os.environ, **rig.env, "NOTIFY_SOCKET": address}, stdin=subprocess.DEVNULL,
                stdout=sink, stderr=subprocess.STDOUT,
            )
        try:
            ready = receive(sock, 60)
            assert ready["READY"] == "1"
            health = re.search(r"health (http://\S+)", ready["STATUS"])
            assert health, ready
            # READY=1 means served: every rank holds its weights when it arrives.
            assert http_status(health.group(1) + "/health")[0] == 200
            (daemon,) = rig.descriptors()
            # The ranks and the supervisor are not the service: they must not inherit the socket.
            for pid in (daemon.pid, daemon.supervisor_pid):
                assert pid and "NOTIFY_SOCKET" not in environ_of(pid)
            process.send_signal(signal.SIGTERM)
            assert receive(sock, 60)["STOPPING"] == "1"
            assert process.wait(timeout=60) == -signal.SIGTERM, output.read_text()
            wait_for(lambda: not rig.descriptors(), timeout=10, what="the rank to remove its files")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


# -- the device check script -------------------------------------------------------------------------------

DEVICE_CHECK = REPO / "benchmarks" / "device_check.sh"


def test_device_check_script_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(DEVICE_CHECK)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_device_check_without_cuda_stops_at_once_with_one_sentence() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    result = subprocess.run([str(DEVICE_CHECK)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("device_check: no CUDA device") and "--device cpu" in line
