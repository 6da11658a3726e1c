"""Bad traffic and strangers at a running job's ports change nothing (utils/elastic/wire.py, key.py).

The short version of `python bench/fuzz/fuzz.py` (100,000 datagrams there): a 3-rank job with the
original per-server command, run undisturbed, then under fire while servers without the job's key
try to join; it must end with the same bits.
"""

import re

import fuzz
import procs
import pytest

from utils.observe.instruments import environ_for

RUN = ["--epochs", "1", "--train-subset", "9600", "--test-subset", "500", "--timeout", "60"]
# Under fire, every step sleeps this long first (RING_INSTRUMENTS's pace), so that the 150 steps last at
# least 15 s: the job still runs when the attack looks for its TCP ports and the strangers ask to join.
PACE = 0.1


@pytest.mark.timeout(500)
def test_bad_datagrams_tcp_junk_and_joins_without_the_key_change_nothing(tmp_path):
    codes, outputs, _ = fuzz.run_job(3, RUN, 300, popen=procs.popen)
    assert codes == [0, 0, 0], [err for _, err in outputs]
    reference = fuzz.final_sha(outputs[0][0])
    wrong = tmp_path / "wrong.key"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)

    def attack(ranks, folder, port):
        def join(name, extra):  # from a folder with no copy of the job's key
            joiner = ["--rank", "3", "--world-size", "4", "--init-method", f"tcp://127.0.0.1:{port}", "--join"]
            strangers[name] = procs.train([*joiner, *RUN[:-2], "--timeout", "4", *extra], timeout=90, cwd=str(tmp_path))

        strangers = {}
        result = fuzz.fire(3000, 3, nmap=False, rate=4000)(ranks, folder, port)
        # one after the other: two processes forked at once by the tests' fork server (tests/support/forker.py),
        # the first to end takes the other's exit code with it (it reads as -9: an open bug there)
        join("no key", [])
        join("wrong key", ["--key-file", str(wrong)])
        return dict(result, **strangers)

    codes, outputs, result = fuzz.run_job(3, RUN, 300, attack, environ_for(pace=PACE), procs.popen)
    assert codes == [0, 0, 0], [err for _, err in outputs]
    assert fuzz.final_sha(outputs[0][0]) == reference
    assert sum(result["sent"].values()) == 3000 and result["captured"] > 0 and len(result["tcp_ports"]) >= 3
    dropped = {}
    for out, _ in outputs:
        line = next(line for line in out.splitlines() if "control datagrams that failed a check" in line)
        for n, why in re.findall(r"([\d,]+) ([a-z ]+?)(?:,|\))", line.split("(", 1)[1]):
            dropped[why] = dropped.get(why, 0) + int(n.replace(",", ""))
    assert {"signature", "size", "replay", "field missing", "field out of range"} <= set(dropped), dropped
    assert sum(dropped.values()) + result["overflowed"] >= 3000  # each one counted, by a rank or by the kernel

    no_key, wrong_key = result["no key"], result["wrong key"]
    assert no_key.returncode == 2 and no_key.stderr.count("\n") == 1, no_key.stderr
    assert "no key for the job's control messages: give --key-file PATH" in no_key.stderr
    assert wrong_key.returncode == 2 and wrong_key.stderr.count("\n") == 1, wrong_key.stderr
    assert "or not the job's key: members drop what it does not sign" in wrong_key.stderr
