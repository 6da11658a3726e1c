"""bench/digests.py's tables, one per machine (the runs themselves stand in: each would be a
train.py of 30 steps; the digests are made up)."""

import json

import digests
import pytest


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A table file with another machine's digests in the older one-machine form; this machine
    is 'amd', and its runs give 'a' for every combination (one that --only picks)."""
    table = tmp_path / "digests.json"
    table.write_text(json.dumps({"machine": "intel", "digests": {"two-pass/plain/none": "i"}}))
    monkeypatch.setattr(digests, "TABLE", table)
    monkeypatch.setattr(digests, "machine", lambda: "amd")
    monkeypatch.setattr(digests, "combinations", lambda: {"two-pass/plain/none": [], "ring/plain/none": []})
    monkeypatch.setattr(digests, "digest_of", lambda flags: "a")
    return table


def test_a_machine_compares_with_its_own_table_and_write_keeps_the_others(here, capsys, monkeypatch):
    assert digests.main([]) == 0  # nothing recorded here: nothing differs, and it says so
    out = capsys.readouterr().out
    assert "no digests recorded on this machine (amd); recorded on: intel" in out and "DIFFERS" not in out
    assert "nothing recorded here yet" in out
    assert digests.main(["--write", "--only", "two-pass"]) == 0
    assert json.loads(here.read_text()) == {
        "machines": {"intel": {"two-pass/plain/none": "i"}, "amd": {"two-pass/plain/none": "a"}}
    }
    capsys.readouterr()
    assert digests.main(["--only", "two-pass"]) == 0
    assert "1 of 1 as recorded here" in capsys.readouterr().out
    monkeypatch.setattr(digests, "digest_of", lambda flags: "b")  # the code changed the bits
    assert digests.main(["--only", "two-pass"]) == 1
    assert "DIFFERS" in capsys.readouterr().out
