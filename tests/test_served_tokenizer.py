"""`wcache verify URL --greedy` compares the tokenizer a served reference engine holds in memory with the
tokenizer files of the checkpoint it claims, through the engine's own POST /tokenize and /detokenize (vLLM's
routes and shapes): an engine whose in-memory tokenizer differs from its files is NOT VERIFIED, with one
sentence naming the difference, although its key (which covers the files) still matches.

The engine here is a real `wcache attach --serve` whose tokenizer was altered in its own process before it
loaded: it encodes "~" as "^" and decodes every answer with a trailing "†".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_fixtures import (
    DaemonRig,
    copy_checkpoint,
    daemon_rig,
    nothing_survives,  # noqa: F401  (autouse: the end-of-module survivor check)
)
from engine_serving import Server, post, serving

ALTERED_TOKENIZER = '''
import wcache.engine.engine as engine_module

_load = engine_module.load_tokenizer


class _Altered:
    def __init__(self, files):
        self.files = files

    def encode(self, text):
        return self.files.encode(text.replace("~", "^"))

    def decode(self, token_ids):
        return self.files.decode(token_ids) + "\\u2020"


engine_module.load_tokenizer = lambda root: _Altered(_load(root))
'''


@pytest.fixture(scope="module")
def altered(tiny_template: Path) -> Iterator[tuple[DaemonRig, Server]]:
    with daemon_rig() as rig:
        model = copy_checkpoint(tiny_template, rig.base / "tiny")
        with serving(rig, model, prelude=ALTERED_TOKENIZER) as server:
            yield rig, server


def verify(rig: DaemonRig, server: Server, prompts: list[str]) -> tuple[int, str, str]:
    """`wcache verify URL --greedy --json` over `prompts`: exit status, the greedy report's problem, stderr."""
    path = rig.base / f"prompts-{len(list(rig.base.glob('prompts-*')))}.txt"
    path.write_text("".join(f"{p}\n" for p in prompts))
    result = rig.cli("verify", server.url, "--greedy", "--json", "--prompts", str(path), "--max-new-tokens", "3")
    problem = json.loads(result.stdout)["greedy"]["problem"] if result.stdout else ""
    return result.returncode, problem, result.stderr


def test_an_engine_encoding_otherwise_than_its_files_is_not_verified(altered: tuple[DaemonRig, Server]) -> None:
    rig, server = altered
    code, problem, stderr = verify(rig, server, ["plain words", "a tilde ~ here"])
    assert code == 1, stderr
    assert problem.startswith("the engine's own tokenizer encodes prompt 1 otherwise than the tokenizer files of")
    assert f"(from token 8: [{ord('^')}, {ord(' ')}, " in problem and f"against [{ord('~')}, " in problem, problem
    assert "Traceback" not in stderr


def test_an_engine_decoding_otherwise_than_its_files_is_not_verified(altered: tuple[DaemonRig, Server]) -> None:
    rig, server = altered
    code, problem, stderr = verify(rig, server, ["plain words"])
    assert code == 1, stderr
    assert problem.startswith("the engine's own tokenizer decodes the answer to prompt 0 as "), problem
    assert "\u2020" in problem and "another tokenizer than the checkpoint it claims" in problem


def test_tokenize_and_detokenize_answer_in_vllms_shape(altered: tuple[DaemonRig, Server]) -> None:
    _, server = altered
    code, answer = post(server.url, json.dumps({"prompt": "a~", "model": "any"}).encode(), "/tokenize")
    assert (code, answer["tokens"], answer["count"]) == (200, [ord("a"), ord("^")], 2), answer
    assert answer["max_model_len"] > 0
    code, answer = post(server.url, json.dumps({"tokens": [ord("o"), ord("k")]}).encode(), "/detokenize")
    assert (code, answer) == (200, {"prompt": "ok\u2020"})
    for route, body in (("/tokenize", {"prompt": 3}), ("/tokenize", {"prompt": "x", "extra": 1}),
                        ("/tokenize", {"prompt": "x", "add_special_tokens": False}), ("/tokenize", {}),
                        ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": [1 << 20]}),
                        ("/detokenize", {"tokens": "12"})):
        code, answer = post(server.url, json.dumps(body).encode(), route)
        assert code == 400 and answer["error"]["message"], (route, body, answer)
