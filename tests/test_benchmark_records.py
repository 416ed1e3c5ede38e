"""Every committed benchmark record names a clean commit at which its script existed and was the script that ran.

For each benchmarks/results/*.json not listed as provisional in docs/benchmarks.md: its `provenance` (written by
benchmarks/common.py) says the tree was clean (no --allow-dirty, no --smoke), the commit is in this repository's
history, and the script and benchmarks/common.py at that commit hash to the sha256 the record carries: the
record was produced by exactly the code that commit holds. The provisional list is read from the docs' table, so
a record leaves it only by being re-measured, and a re-measured record cannot stay on it.
"""

import hashlib
import json
import re
import subprocess

import pytest
from helpers import REPO

RESULTS = REPO / "benchmarks" / "results"
DOCS = REPO / "docs" / "benchmarks.md"


def provisional() -> set[str]:
    """The JSON names of docs/benchmarks.md's table of records measured before the provenance check (none once every
    record was re-measured and the table removed)."""
    text = DOCS.read_text()
    if "| JSON | commit it names |" not in text:
        return set()
    table = text[text.index("| JSON | commit it names |") :].split("\n\n", 1)[0]
    return {name for line in table.splitlines()[2:] for name in re.findall(r"`([\w.]+\.json)`", line.split("|")[1])}


def git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=False)


def blob_sha256(commit: str, path: str) -> str | None:
    shown = git("show", f"{commit}:{path}")
    return hashlib.sha256(shown.stdout).hexdigest() if shown.returncode == 0 else None


RECORDS = sorted(p.name for p in RESULTS.glob("*.json"))


def test_the_provisional_list_names_committed_records():
    assert provisional() <= set(RECORDS), provisional() - set(RECORDS)


@pytest.mark.skipif(git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true", reason="shallow clone")
@pytest.mark.parametrize("name", RECORDS)
def test_record_names_a_clean_commit_whose_script_produced_it(name):
    record = json.loads((RESULTS / name).read_text())
    p = record.get("provenance")
    if name in provisional():
        assert not (p and p.get("dirty") is False), f"{name} was re-measured: drop it from the provisional table"
        pytest.skip("provisional in docs/benchmarks.md: measured before the provenance check")
    assert p, f"{name} has no provenance; re-run its command (docs/benchmarks.md) at a clean commit"
    assert (p["dirty"], p["allow_dirty"], p["smoke"]) == (False, False, False), f"{name}: not a clean full run"
    assert git("cat-file", "-e", f"{p['commit']}^{{commit}}").returncode == 0, f"{name}: {p['commit']} not in history"
    assert blob_sha256(p["commit"], p["script"]) == p["script_sha256"], f"{name}: {p['script']} differs at the commit"
    assert blob_sha256(p["commit"], "benchmarks/common.py") == p["common_sha256"], f"{name}: common.py differs"


DEVICE = RESULTS / "device"
DEVICE_RECORDS = sorted(p.name for p in DEVICE.glob("*.json"))


def device_table() -> dict[str, str]:
    """docs/benchmarks.md's table of records from a lent GPU machine: JSON name -> the commit whose tree ran."""
    text = DOCS.read_text()
    if "| device JSON | tree of commit |" not in text:
        return {}
    table = text[text.index("| device JSON | tree of commit |") :].split("\n\n", 1)[0]
    found = {}
    for line in table.splitlines()[2:]:
        cells = line.split("|")
        names = re.findall(r"`([\w.]+\.json)`", cells[1]) if len(cells) > 2 else []
        commits = re.findall(r"`([0-9a-f]{7,40})`", cells[2]) if len(cells) > 2 else []
        bad = f"docs/benchmarks.md's device table: not a `NAME.json` | `commit` row: {line!r}"
        assert len(names) == 1 and len(commits) == 1, bad
        found[names[0]] = commits[0]
    return found


def test_every_device_record_is_in_the_docs_table_and_the_table_names_only_records():
    assert set(device_table()) == set(DEVICE_RECORDS)


@pytest.mark.skipif(git("rev-parse", "--is-shallow-repository").stdout.strip() == b"true", reason="shallow clone")
@pytest.mark.parametrize("name", DEVICE_RECORDS)
def test_device_record_was_produced_by_the_scripts_of_the_commit_the_docs_name(name):
    # A lent GPU machine runs a copy of the working tree whose git metadata may be older than the tree (so the record
    # says dirty and needed --allow-dirty): what ties it to the code is the script and common.py it hashed, which must
    # be the blobs of the commit docs/benchmarks.md names, and it must be a full run (not --smoke) on a GPU.
    p = json.loads((DEVICE / name).read_text())["provenance"]
    commit = device_table()[name]
    assert git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, f"{name}: {commit} not in history"
    assert blob_sha256(commit, p["script"]) == p["script_sha256"], f"{name}: {p['script']} differs at {commit}"
    assert blob_sha256(commit, "benchmarks/common.py") == p["common_sha256"], f"{name}: common.py differs at {commit}"
    assert p["smoke"] is False and p["device"] == "cuda" and p["gpu"], name
    # the tree that ran was the named commit's: every file that differs between the commit its git metadata named and
    # the named commit is among the changes that metadata listed (so the record's tree can be the named commit's)
    differ = git("diff", "--name-only", p["commit"], commit).stdout.decode().split()
    listed = {change[3:].strip('"') for change in p["changes"] + p.get("results_changed", [])}
    assert set(differ) <= listed, f"{name}: {sorted(set(differ) - listed)} differ from {commit} but were not changed"
