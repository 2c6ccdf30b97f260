"""Wrong input to every verb: exit 2 with one line naming the problem, never a traceback; a
closed pipe ends quietly; the demo refuses too few steps and says what it did; log lines
and progress bars do not mix. The real command in a subprocess."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, child_env, run_cli, save
from tools.testkit.ports import free_port

PLAN = ["--bytes-per-param", "14", "--ranks", "8", "--storage-gbps", "1", "--iteration-s", "1",
        "--mtbf-h", "10"]


def cli(*argv: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "dcp_plus", *argv], cwd=ROOT,
                          env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return proc


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    """{missing}: no such path, {file}: a regular file, {empty}: an empty directory,
    {full}: a non-empty directory not made by the demo."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "a-file").write_text("not a directory")
    return {"missing": str(tmp_path / "no" / "such"), "file": str(tmp_path / "a-file"),
            "empty": str(tmp_path / "empty"), "full": str(tmp_path / "full")}


# (argv with {place} fields, what the last stderr line must say); argparse's own errors end
# with "dcp-plus VERB: error: ...", ours are a single line "dcp-plus VERB: ..."
WRONG = [
    (["demo", "{empty}", "--steps", "0"], "needs at least 7"),
    (["demo", "{empty}", "--steps", "3"], "needs at least 7"),
    (["demo", "{empty}", "--steps", "many"], "invalid int value: 'many'"),
    (["demo", "{empty}", "--seed", "x"], "invalid int value: 'x'"),
    (["demo", "{file}"], "is a file, expected a directory"),
    (["demo", "{full}"], "is not empty and was not made by the demo"),
    (["demo", "s3://bucket/run"], "local directories only"),
    (["inspect", "{missing}"], "no commit record"),
    (["inspect", "{file}"], "not a directory"),
    (["verify", "{file}"], "not a directory"),
    (["ls", "{missing}"], "does not exist"),
    (["ls", "{file}"], "is a file, expected a directory"),
    (["ls", "{empty}", "--storage-option", "novalue"], "expected KEY=VALUE"),
    (["ls", "http://host/run"], "no checkpoint backend for http://"),
    (["gc", "{missing}"], "does not exist"),
    (["gc", "{file}", "--dry-run"], "is a file, expected a directory"),
    (["gc", "{empty}", "--keep-last", "0"], "keep at least 1"),
    (["inspect", "{empty}", "--storage-option", "k=v"], "apply to URLs only"),
    (["verify", "{empty}", "--storage-option", "novalue"], "expected KEY=VALUE"),
    (["convert", "{missing}", "{empty}"], "no commit record"),
    (["convert", "{file}", "{empty}"], "not a directory"),
    (["diff", "{missing}", "{empty}"], "no commit record"),
    (["diff", "{file}", "{empty}"], "not a directory"),
    (["plan", "--params", "-5", *PLAN], "argument --params: not a count: '-5'"),
    (["plan", "--params", "7B", *PLAN[:2], "--ranks", "0", *PLAN[4:]], "ranks must be"),
    (["plan", *PLAN], "the following arguments are required: --params"),
    (["bench", "--size", "-1"], "not a size: '-1'"),
    (["bench", "--ranks", "0"], "--ranks must be at least 1"),
    (["bench", "--saves", "-2"], "--saves must be at least 1"),
    (["bench", "--timeline-steps", "-1"], "--timeline-steps must be 0"),
    (["bench", "--storage-option", "novalue"], "expected KEY=VALUE"),
    (["bench", "--target", "{file}"], "is a file, expected a directory"),
    (["bench", "--target", "{missing}"], "does not exist"),
    (["bench", "--target", "{empty}", "--plot", "{missing}/x.png"], "does not exist"),
    (["bench", "--target", "{empty}", "--json", "{empty}"], "is a directory, expected a file"),
    (["bench", "--cold", "warm"], "invalid choice: 'warm'"),
    (["nosuchverb"], "invalid choice: 'nosuchverb'"),
]


@pytest.mark.parametrize("argv,says", WRONG, ids=[" ".join(a) for a, _ in WRONG])
def test_wrong_input_exits_2_with_one_line_naming_the_problem(places, argv, says):
    args = [a.format(**places) for a in argv]
    proc = run_cli(*args)  # in this process: ~30 cases, each a 3 s interpreter start-up else
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines and says in lines[-1], proc.stderr
    verb = "dcp-plus" if argv[0] == "nosuchverb" else f"dcp-plus {argv[0]}"
    assert lines[-1].startswith(f"{verb}: "), lines[-1]
    if ": error: " not in lines[-1]:  # ours, not argparse's usage + error
        assert len(lines) == 1, proc.stderr
        assert "internal error" not in lines[0]
    assert os.listdir(places["empty"]) == [], "a refused command left something behind"
    assert not os.path.exists(places["missing"])


def _no_credentials_env() -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    return env


@pytest.mark.parametrize("creds,says", [
    ([], "NoCredentialsError"),
    (["key=someone", "secret=wrong"], "Could not connect to the endpoint URL"),
])
def test_bench_s3_target_unreachable_fails_fast_in_one_line(creds, says):
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    opts = [x for kv in [f"endpoint_url={endpoint}", *creds] for x in ("--storage-option", kv)]
    proc = cli("bench", "--quick", "--target", "s3://bucket/run", *opts,
               env=_no_credentials_env(), timeout=90)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-plus bench: --target s3://bucket/run: "
                                                   "cannot write there"), proc.stderr
    assert says in lines[0] and proc.stdout == ""


# -- a closed pipe ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> dict[str, str]:
    """A checkpoint of 3000 tensors and a root of 2000 checkpoint folders: each listing is
    far larger than a pipe's buffer."""
    base = tmp_path_factory.mktemp("many")
    ckpt = base / "ckpt"
    save({f"layers.{i}.weight": torch.zeros(2) for i in range(3000)}, ckpt)
    root = base / "root"
    for step in range(1, 2001):
        (root / f"step_{step:08d}").mkdir(parents=True)
    return {"ckpt": str(ckpt), "root": str(root)}


@pytest.mark.parametrize("argv,read_one", [
    (["inspect", "{ckpt}"], True),
    (["inspect", "{ckpt}"], False),
    (["ls", "{root}"], True),
    (["ls", "{root}", "--json"], False),
    (["plan", "--params", "7B", *PLAN], True),
    (["plan", "--params", "7B", *PLAN], False),
])
def test_a_closed_pipe_ends_the_command_quietly(many, argv, read_one):
    """Like ``dcp-plus inspect DIR | head -1``: the reader goes away after one line, or
    before any (then the failing write is the last flush)."""
    args = [a.format(**many) for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "dcp_plus", *args], cwd=ROOT,
                            env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    if read_one:
        assert proc.stdout.readline().strip()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert "Traceback" not in err, err


# -- the demo -----------------------------------------------------------------------------------


def test_demo_at_its_minimum_saves_is_killed_and_resumes_bit_exact(tmp_path):
    root = tmp_path / "demo"
    proc = cli("demo", str(root), "--steps", "7", "--seed", "3", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "trainer pid killed by SIGKILL" in out
    assert "found and removed the uncommitted checkpoint" in out and "step_00000007" in out
    assert "resumed from committed step 6" in out
    assert "resumed state at step 6: bit-exact" in out and "final state at step 7: bit-exact" in out
    # not a terminal: no progress bars, and torch's INFO lines stay out at the default level
    assert "\r" not in proc.stderr and "\x1b[" not in proc.stderr, proc.stderr
    assert " INFO " not in proc.stderr and "INFO -" not in proc.stderr, proc.stderr


# -- logging and bars -----------------------------------------------------------------------------


_BAR_AND_LOGS = textwrap.dedent("""
    import logging, sys
    from tqdm import tqdm
    from dcp_plus.cli import logs
    logs.configure(verbose=False)
    with logs.bars_safe():
        bar = tqdm(total=10, desc="working", file=sys.stderr, disable=None, mininterval=0)
        bar.update(3)
        logging.getLogger("dcp_plus.demo").warning("a warning while the bar runs")
        logging.getLogger().info("Checkpoint background process is running...")
        logging.getLogger("dcp_plus.demo").info("an info line")
        bar.update(3)
        bar.close()
    """)


def test_log_lines_print_above_a_bar_on_a_terminal():
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    try:
        proc = subprocess.Popen([sys.executable, "-c", _BAR_AND_LOGS], cwd=ROOT,
                                env=child_env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(master)
    text = b"".join(chunks).decode()
    assert "working" in text and "3/10" in text and "6/10" in text, text  # a bar on a tty
    line = "WARNING dcp_plus.demo: a warning while the bar runs"
    at = text.index(line)
    assert at == 0 or text[at - 1] in "\r\n", repr(text)  # on a line of its own
    assert text[at + len(line)] in "\r\n", repr(text)
    assert "background process" not in text and "an info line" not in text


def test_no_bar_and_no_info_when_stderr_is_not_a_terminal():
    proc = subprocess.run([sys.executable, "-c", _BAR_AND_LOGS], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "WARNING dcp_plus.demo: a warning while the bar runs\n"
