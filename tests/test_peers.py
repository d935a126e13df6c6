"""The test setup README promises: its test command passes on a fresh machine without the peers (their tests
are skipped there, and fail under CI=true), and CI installs nothing beyond that command and the peers README names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.peers import peer_module

ROOT = Path(__file__).resolve().parents[1]
# the packages of .ci/peer_packages.sh, by import name
PEER_PACKAGES = ("speculators", "hs_connectors", "loguru", "openai", "mtbench_evaluator", "mooncake")


def test_a_missing_peer_package_is_skipped_here_and_fails_in_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_peer does not import.*bash .ci/peer_packages.sh"):
        peer_module("no_such_peer")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_peer does not import"):
        peer_module("no_such_peer")


def test_a_missing_mooncake_is_skipped_here_and_fails_in_ci(monkeypatch):
    import sys

    from tests.peers import mooncake_store

    monkeypatch.setitem(sys.modules, "mooncake", None)  # as where the wheel is not installed
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs Mooncake, which is not installed"):
        mooncake_store()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="needs Mooncake, which is not installed"):
        mooncake_store()


def test_ci_run_sets_ci_itself_and_readme_says_so():
    """Running `.ci/run` anywhere means CI: a missing peer fails there, wherever it runs."""
    lines = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "export CI=true" in lines, ".ci/run does not `export CI=true`: a missing peer would be skipped"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`.ci/run` sets `CI=true`" in readme, "README's test section does not say that .ci/run sets CI=true"


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"Set up and run the tests:\n\n```bash\n(.+?)\n```", readme, re.S).group(1)


def test_ci_installs_what_readmes_test_command_installs_and_the_peers_readme_names():
    readme, command = (ROOT / "README.md").read_text(), readme_test_command()
    installs = [" ".join(a.split()) for a in re.findall(r"pip install ([^&\n]+)", command)]
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "pip install" in line:
            wanted = " ".join(w for w in line.split("pip install", 1)[1].split() if w != "--quiet")
            assert wanted in installs, f".ci/run installs {wanted!r}, which README's test command does not"
        if line.startswith("bash "):
            assert f"`{line}`" in readme, f".ci/run runs `{line}`, which README does not name"
    assert "python -m pytest" in command


def test_tests_reach_the_peer_packages_through_tests_peers():
    """`pytest.importorskip` of a peer would skip under CI too: CI could pass without running the peer."""
    names = "|".join(PEER_PACKAGES)
    pattern = re.compile(rf"importorskip\(\s*[\"'](?:{names})|find_spec\(\s*[\"'](?:{names})")
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in (ROOT / "tests").rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
