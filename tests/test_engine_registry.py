"""Adding an engine, done: one folder (a stub engine written under tmp) and one registry entry reach
`verify --greedy --engine`, `verify URL`, `switch URL` and `doctor` (its range and its check), and its placement
borrows the shared torch-only one, as docs/layout.md ("Adding an engine") says.

The served side is a real HTTP server on a real socket that is neither a reference engine (no /v1/weights) nor
a vLLM server (no /version): the registry asks each served engine in order, and only the stub claims it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import sys
import threading
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import wcache_in_process
from wcache.integrations import registry
from wcache.integrations.registry import EngineEntry
from wcache.plan.spec import PlanSpec

ROOT = Path(__file__).resolve().parents[1]

# The stub engine's folder: what `integrations/NAME/` holds for a real engine, module by module.
STUB = {
    "__init__.py": '"""A stub engine: what an engine\'s folder holds."""\n',
    "greedy.py": '''
from wcache.integrations.registry import GreedyAttach, GreedyTokens


def run_greedy(model, plan, prompts, max_new_tokens, options, device):
    tokens = [[len(prompt) + step for step in range(max_new_tokens)] for prompt in prompts]
    return GreedyTokens(tokens, [list(t) for t in tokens], GreedyAttach("stub", "hit", daemon=str(model)))
''',
    "served.py": '''
from wcache.integrations.registry import GreedyAttach
from wcache.serving.client import EngineRequestError, call_engine
from wcache.verify import GreedyReport, compare_prompts


def _stub(url):
    try:
        return call_engine(url, "GET", "/stub")
    except EngineRequestError as exc:
        if exc.status != 404:
            raise
        return None


def verify(url, prompts, max_new_tokens):
    if _stub(url) is None:
        return None
    tokens = [[len(p)] * max_new_tokens for p in prompts]
    return GreedyReport(compare_prompts(prompts, tokens, tokens), GreedyAttach("stub (served)", "hit", url=url))


def switch(url, model, daemon):
    found = _stub(url)
    if found is None:
        return None
    return {"previous": {"model": found["model"], "key_id": "k-old"}, "current": {"model": str(model),
            "key_id": "k-new"}, "attach": {"daemon": daemon}, "switch_ms": 1.5}
''',
    "doctor.py": '''
def check(nvidia_gpu):
    return "warn", f"the stub engine was asked (GPU: {nvidia_gpu})"
''',
    "version.py": '''
from wcache.integrations.versions import SupportedVersions

SUPPORTED = SupportedVersions(("stub-engine",), ">=1.2,<2")
''',
    "placement.py": '''
from wcache.integrations.placement import parameter_slots, replace_parameter, same_kind


def place(model, tensors):
    slots = parameter_slots(model)
    for name, param in dict(model.named_parameters()).items():
        replace_parameter(slots[id(param)], same_kind(param, tensors[name]))
''',
}


class _StubServer(BaseHTTPRequestHandler):
    """Answers GET /stub (and counts every path asked); 404 for anything else, as a foreign server would."""

    asked: ClassVar[list[str]] = []
    answers_stub = True

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        type(self).asked.append(f"{self.command} {self.path}")
        stub = self.path == "/stub" and self.answers_stub
        body, status = (json.dumps({"model": "/old"}).encode(), 200) if stub else (b"{}", 404)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _install_metadata(site: Path, version: str) -> None:
    """What pip leaves beside an installed distribution stub-engine: the metadata doctor reads its version from."""
    for old in site.glob("stub_engine-*.dist-info"):
        shutil.rmtree(old)
    info = site / f"stub_engine-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: stub-engine\nVersion: {version}\n")


@pytest.fixture
def stub_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The stub's folder on sys.path (installed as distribution stub-engine 1.4) and its entry appended to the
    registry; its served engine's URL."""
    folder = tmp_path / "site" / "stub_engine"
    folder.mkdir(parents=True)
    for name, text in STUB.items():
        (folder / name).write_text(text)
    _install_metadata(folder.parent, "1.4")
    monkeypatch.syspath_prepend(str(folder.parent))
    entry = EngineEntry("stub", "stub_engine.greedy:run_greedy", tensor_parallel=False, own_plan=False,
                        placement="stub_engine.placement:place", versions="stub_engine.version:SUPPORTED",
                        served_verify="stub_engine.served:verify", served_switch="stub_engine.served:switch",
                        served_as="a stub engine (no /stub)", doctor_check="stub_engine.doctor:check")
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, entry))
    monkeypatch.setattr(registry, "ENGINES", (*registry.ENGINES, "stub"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _StubServer.asked, _StubServer.answers_stub = [], True
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        for name in [m for m in sys.modules if m.split(".")[0] == "stub_engine"]:
            del sys.modules[name]


def test_verify_greedy_runs_the_added_engines_runner(stub_engine: str, tmp_path: Path) -> None:
    from wcache.verify import verify_greedy

    report = verify_greedy(tmp_path / "model", PlanSpec(), ["ab", "abcd"], 3, engine="stub")
    assert report.all_match and report.attach.engine == "stub"
    assert [r.cached_tokens for r in report.results] == [[2, 3, 4], [4, 5, 6]]
    assert report.attach.daemon == str(tmp_path / "model")


def test_verify_url_asks_each_served_engine_in_order(stub_engine: str) -> None:
    from wcache.verify_served import verify_served

    report = verify_served(stub_engine, ["abc"], 2)
    assert report.all_match and report.attach.engine == "stub (served)"
    assert report.attach.url == stub_engine
    # The reference engine's question, then vLLM's, then the stub's.
    assert _StubServer.asked == ["GET /v1/weights", "GET /version", "GET /stub"]


def test_switch_reaches_the_added_engine(stub_engine: str, tmp_path: Path) -> None:
    model = tmp_path / "new"
    model.mkdir()
    result = wcache_in_process("switch", stub_engine, str(model), "--daemon", "d-1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"SWITCHED {stub_engine}: k-old → k-new ({model}, daemon d-1) in 1.5 ms"
    assert _StubServer.asked == ["POST /v1/weights", "GET /version", "GET /stub"]


def test_an_engine_no_entry_recognizes_is_named_in_one_sentence(stub_engine: str) -> None:
    _StubServer.answers_stub = False
    result = wcache_in_process("verify", stub_engine, "--greedy", "--num-prompts", "1")
    assert result.returncode != 0
    assert (f"{stub_engine} is neither a wcache reference engine (no /v1/weights) nor a vLLM server (no /version) "
            "nor a stub engine (no /stub).") in " ".join(result.stderr.split())


def test_doctor_runs_the_added_engines_check(stub_engine: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    result = wcache_in_process("doctor", "--json", "--run-dir", str(run_dir))
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    assert list(findings)[7:10] == ["vllm", "transformers", "stub"]
    assert findings["stub"]["status"] == "warn"
    assert findings["stub"]["message"].startswith("the stub engine was asked (GPU: ")


def test_doctor_checks_the_added_engines_range(stub_engine: str, tmp_path: Path) -> None:
    # The entry names its range's owner; doctor's check of it is the same as every engine's, before its own.
    _install_metadata(tmp_path / "site", "2.0.1")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    result = wcache_in_process("doctor", "--json", "--run-dir", str(run_dir))
    assert result.returncode == 1
    stub = next(f for f in json.loads(result.stdout)["findings"] if f["check"] == "stub")
    assert stub == {"check": "stub", "status": "fail", "message": "stub-engine 2.0.1 is outside the versions wcache "
                    "is tested with (>=1.2,<2); install one of those (pip install 'stub-engine>=1.2,<2')"}


def test_the_added_engines_placement_borrows_the_shared_one(stub_engine: str) -> None:
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 3))
    tensors = {name: torch.full(tuple(p.shape), 7.0) for name, p in model.named_parameters()}
    place = registry.engine_entry("stub").load_placement()
    place(model, tensors)
    assert all(p.data_ptr() == tensors[name].data_ptr() for name, p in model.named_parameters())


def _defined(reference: str) -> bool:
    """Whether the module of a "module:name" defines that name, read from its source (vLLM's imports vLLM)."""
    module, _, name = reference.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, reference
    body: list[ast.stmt] = ast.parse(Path(spec.origin).read_text()).body
    for part in name.split("."):
        found = [node for node in body if (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == part)
                 or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == part for t in node.targets))]
        if not found:
            return False
        body = getattr(found[0], "body", [])
    return True


def test_every_entry_names_its_placement_and_range() -> None:
    for entry in registry.REGISTRY:
        assert _defined(entry.placement), entry.name
        assert entry.versions is None or _defined(entry.versions), entry.name
    assert [entry.name for entry in registry.REGISTRY if entry.versions is None] == ["reference"]


def test_the_transformers_range_has_one_owner() -> None:
    from wcache.integrations.transformers.version import SUPPORTED

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["transformers"] == [f"transformers{SUPPORTED.range}"]
    assert f"transformers{SUPPORTED.range}" in extras["test"]
