"""scripts/plot_metrics.py: learning curves from metrics JSONL files; bad input is one line, exit 2."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLOT = os.path.join(REPO, "scripts", "plot_metrics.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def plot(*args, cwd=None):
    return subprocess.run(
        [sys.executable, PLOT, *map(str, args)], cwd=cwd or REPO, capture_output=True, text=True, timeout=90
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(world_size, allreduce, epochs, busbw=False):
    out = []
    for e in range(1, epochs + 1):
        row = {
            "epoch": e,
            "train_loss": 0.3 / e,
            "test_accuracy": 0.97 + 0.004 * e,
            "seconds": 30.0 / world_size,
            "comm_share": 0.2,
            "world_size": world_size,
            "allreduce": allreduce,
        }
        if busbw:
            row["busbw_gbps"] = 0.1 + 0.001 * e
        out.append(row)
    return out


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG"
    assert data[12:16] == b"IHDR" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600 and height >= 400


@pytest.mark.timeout(120)
def test_two_files_with_and_without_busbw_make_a_png(tmp_path):
    a = write_jsonl(tmp_path / "metrics.jsonl", rows(2, "two-pass", 5) + rows(4, "ring", 3))  # two runs, one file
    b = write_jsonl(tmp_path / "gloo.jsonl", rows(4, "gloo", 4, busbw=True))
    out = tmp_path / "out" / "curves.png"  # the folder does not exist yet
    r = plot(a, b, "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "3 run(s), 12 epoch(s)" in r.stdout
    assert_png(out)
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # atomic: no temporary left behind


@pytest.mark.timeout(120)
def test_a_resumed_epoch_replaces_the_earlier_line(tmp_path):
    lines = rows(2, "two-pass", 3)
    lines.insert(2, dict(lines[1], train_loss=9.0))  # epoch 2 logged twice; the later line wins
    f = write_jsonl(tmp_path / "m.jsonl", lines)
    r = plot(f, "-o", tmp_path / "c.png")
    assert r.returncode == 0, r.stderr
    assert "1 run(s), 3 epoch(s)" in r.stdout
    assert_png(tmp_path / "c.png")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("", "empty"),
        ("\n\n", "empty"),
        ('{"epoch": 1, "train_loss": 0.1, "test_accuracy": 0.98}\nnot json\n', ":2: not a JSON line"),
        ('{"epoch": 1, "test_accuracy": 0.98}\n', ":1: missing train_loss"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"epoch": "one", "train_loss": 0.1, "test_accuracy": 0.98}\n', "'epoch' must be a number"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, content, message):
    f = tmp_path / "metrics.jsonl"
    if content is not None:
        f.write_text(content)
    out = tmp_path / "c.png"
    r = plot(f, "-o", out)
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("plot_metrics.py: error: ") and message in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_good_file_and_a_missing_one_writes_nothing(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", rows(2, "ring", 2))
    out = tmp_path / "c.png"
    r = plot(good, tmp_path / "missing.jsonl", "-o", out)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "missing.jsonl: no such file" in r.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
def test_no_arguments_is_one_line_and_exit_2():
    r = plot()
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.timeout(120)
def test_the_loss_at_every_report_and_the_test_images_in_the_title(tmp_path):
    """Newer lines hold the loss of every progress report and the number of test images."""
    import plot_metrics

    lines = rows(2, "two-pass", 2)
    for row in lines:
        row["test_images"] = 2000
        row["losses"] = [[(row["epoch"] - 1) * 30 + s, 1.0 / s] for s in range(3, 31, 3)]
    f = write_jsonl(tmp_path / "m.jsonl", lines)
    r = plot(f, "--output", tmp_path / "c.png")
    assert r.returncode == 0 and "1 run(s), 2 epoch(s)" in r.stdout, r.stderr
    assert_png(tmp_path / "c.png")
    runs = plot_metrics.read_runs(str(f))
    assert plot_metrics.accuracy_title([("m", runs[0])]) == "test accuracy (2,000 images)"
    points = plot_metrics.progress_points(runs[0])
    assert len(points) == 20 and points[0] == (0.1, 1 / 3) and points[-1] == (2.0, 1 / 30)
    old = plot_metrics.read_runs(str(write_jsonl(tmp_path / "old.jsonl", rows(2, "ring", 2))))
    assert plot_metrics.accuracy_title([("m", runs[0]), ("old", old[0])]) == "test accuracy"
    assert plot_metrics.progress_points(old[0]) == []
    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(lines[0], losses=[[5, 0.1], [4, 0.2]])])
    r = plot(bad, "-o", tmp_path / "d.png")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "rising" in r.stderr, r.stderr
