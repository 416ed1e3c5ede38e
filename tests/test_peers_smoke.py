"""benchmarks/peers.py --smoke without a peer installed: it skips the peer, says so, and still writes its JSON."""

import json
from pathlib import Path

import pytest
from helpers import REPO, run

pytestmark = pytest.mark.slow


def test_peers_smoke_skips_a_missing_peer(tmp_path: Path) -> None:
    """peers.py --smoke with diffusers made unimportable (a shadowing package that raises ImportError): it says
    that it skips diffusers, exits 0, and its JSON has this project's (bare-loop: the cheapest) row and no diffusers
    row."""
    hidden = tmp_path / "hide" / "diffusers"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("diffusers hidden by tests/test_peers_smoke.py")\n')
    out = tmp_path / "peers.json"
    result = run("python", "benchmarks/peers.py", "--smoke", "--rows", "ours_bare,diffusers", "--out", out, timeout=300,
                 extra_env={"PYTHONPATH": f"{hidden.parent}:{REPO / 'tests'}"})  # fmt: skip
    output = result.stdout + result.stderr
    assert any("skip" in line.lower() and "diffusers" in line for line in output.splitlines()), output
    tools = [row["tool"] for row in json.loads(out.read_text())["rows"]]
    assert any(t.startswith("lightning-ddpm") for t in tools) and "diffusers" not in tools, tools
