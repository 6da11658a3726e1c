"""The user's own ssh, as `train.py --hosts` uses it: never a password prompt, never a host-key bypass.

    Ssh()                                  the user's `ssh`, with their ~/.ssh/config
    ssh.on(server, python, command, ...)   the command line that runs utils/setup/on_server.py there
    ssh.run(server, python, command, ...)  run it; (exit code, stdout, stderr), within `timeout` seconds
    trouble(host, code, stderr)            what went wrong with ssh itself, in words, or None

The user's ~/.ssh/config, keys, agent and ports apply as they do for `ssh HOST`. BatchMode: a server
that would ask for a password (or a passphrase, or to accept an unknown host key) is an error at
once, not a prompt. StrictHostKeyChecking is left as the user has it: an unknown or changed host
key is refused as ssh refuses it, and the line says how to accept it the usual way.
"""

import json
import shlex
import subprocess

NO_FOLDER, NO_PYTHON = 97, 98  # the remote shell's exit codes: no such folder; no such Python
CONNECT_SECONDS = 10
SSH_FAILED = 255


class Ssh:
    def __init__(self, command=("ssh",)):
        self.command = list(command)

    def on(self, host, folder, pythons, command, request):
        """argv of ssh running `python -m utils.setup.on_server COMMAND REQUEST` in `folder` on `host`,
        with the first of `pythons` that is there."""
        module = f"-m utils.setup.on_server {command} {shlex.quote(json.dumps(request))}"
        tries = " ".join(shlex.quote(p) for p in pythons)
        remote = (
            f"cd {shlex.quote(folder)} 2>/dev/null || exit {NO_FOLDER}; "
            f'for p in {tries}; do if command -v "$p" >/dev/null 2>&1; then exec "$p" {module}; fi; done; '
            f"exit {NO_PYTHON}"
        )
        options = ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_SECONDS}", "-o", "ServerAliveInterval=15"]
        return [*self.command, *options, host, remote]

    def run(self, host, folder, pythons, command, request, stdin=b"", timeout=90):
        """(exit code, stdout, stderr) of `on(...)`; exit code None after `timeout` seconds (killed)."""
        try:
            done = subprocess.run(
                self.on(host, folder, pythons, command, request),
                input=stdin,
                capture_output=True,
                timeout=timeout,
                start_new_session=True,  # a Ctrl-C at the terminal is the launcher's to handle, not ssh's
            )
        except subprocess.TimeoutExpired:
            return None, "", f"no answer within {timeout} s"
        except FileNotFoundError:
            return SSH_FAILED, "", f"{self.command[0]}: command not found (install OpenSSH's client)"
        return done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")


def trouble(host, code, stderr, folder, pythons):
    """One line: why ssh to `host` (or the shell there) failed and what to run about it; None if it did not."""
    said = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if code is None:
        return f"{host}: no answer over ssh ({said}); is it up?"
    if code == NO_FOLDER:
        return f"{host}: no folder {folder} there; copy this one: rsync -a {shlex.quote(folder)}/ {host}:{folder}/"
    if code == NO_PYTHON:
        return f"{host}: no Python at {' or '.join(pythons)}; give the one with torch there: --python PATH"
    if code != SSH_FAILED:
        return None
    for words, hint in (
        ("Could not resolve hostname", "unknown host name; check it, or add it to ~/.ssh/config"),
        ("Permission denied", f"ssh asks for a password or refuses your key; give it your key: ssh-copy-id {host}"),
        ("Host key verification failed", f"its host key is not known here (or changed); connect once: ssh {host}"),
        ("Connection refused", "ssh refused the connection; is sshd running there?"),
        ("timed out", "ssh timed out; is it up, and is the name right?"),
        ("No route to host", "no route to it; is it up?"),
    ):
        if words in stderr:
            return f"{host}: {hint} ({said})"
    return f"{host}: ssh failed ({said or 'exit 255'})"
