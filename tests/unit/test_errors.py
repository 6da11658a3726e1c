"""One-line errors: gloo's advice and assertion noise are cut, the peer's address stays."""

import pytest

from utils.errors import first_line


@pytest.mark.parametrize(
    "raw, line",
    [
        (
            "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
            "Connection closed by peer [127.0.0.1]:61121. This is typically caused by a remote worker crashing. "
            "Check the logs of the remote worker before reporting an error. GLHF! \N{UMBRELLA ON GROUND}\ufe0f",
            "Connection closed by peer [127.0.0.1]:61121",
        ),
        (
            "[pair.cc:534] Read error [10.0.0.2]:41553: Connection reset by peer. This is typically caused by a remote "
            "worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. "
            "GLHF! \N{UMBRELLA ON GROUND}\ufe0f",
            "Read error [10.0.0.2]:41553: Connection reset by peer",
        ),
        (
            "[enforce fail at pair.cc:809] state_ >= CONNECTED. 1 vs 4. Pair is not connected ([127.0.0.1]:17835 <--> "
            "[none])",
            "Pair is not connected ([127.0.0.1]:17835 <--> [none])",
        ),
        (
            "[unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete\nmore",
            "Timed out waiting 5000ms for recv operation to complete",
        ),
        ("", "RuntimeError"),
    ],
)
def test_first_line_keeps_the_gist_and_the_address(raw, line):
    assert first_line(RuntimeError(raw)) == line
