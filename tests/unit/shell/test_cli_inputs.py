"""What a command writes, reads or connects to is checked when its command line is parsed:
one line and exit status 2, before any server starts or any run begins."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from thunderagent.cli.main import main
from thunderagent.shell.argtypes import nats_url, output_dir, output_file, readable_file
from thunderagent.stack.demo import conversation_turns


def test_output_paths(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    deeper = tmp_path / "new" / "deeper" / "r.json"
    assert output_file(str(deeper)) == deeper
    assert output_dir(str(tmp_path / "plots")) == tmp_path / "plots"
    assert output_dir(str(tmp_path)) == tmp_path
    for parse, text, words in [
        (output_file, str(tmp_path), "is a folder"),
        (output_file, str(afile / "x.json"), "is not a folder"),
        (output_dir, str(afile), "is not a folder"),
        (output_dir, str(afile / "plots"), "is not a folder"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)


def test_nats_urls_and_readable_files(tmp_path: Path) -> None:
    assert nats_url("nats://127.0.0.1:4222,tls://nats.internal") == (
        "nats://127.0.0.1:4222,tls://nats.internal"
    )
    for text in ["notaurl", "http://127.0.0.1:4222", "nats://", "nats://h:99999"]:
        with pytest.raises(argparse.ArgumentTypeError):
            nats_url(text)
    key = tmp_path / "key.pem"
    key.write_text("k")
    assert readable_file(str(key)) == key
    with pytest.raises(argparse.ArgumentTypeError, match="not a file"):
        readable_file(str(tmp_path))


def test_a_tls_certificate_without_its_key_is_refused_before_anything_starts(
    tmp_path: Path, capsys
) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("c")
    with pytest.raises(SystemExit) as info:  # used to start NATS without TLS
        main(["up", "--tls-cert", str(cert)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "thunderagent up: error: --tls-cert and --tls-key go together (NATS would run without TLS)"
    )


def test_the_demo_sends_exactly_the_requests_asked() -> None:
    assert conversation_turns(200) == [4] * 50  # the default: the workload it always was
    assert conversation_turns(10) == [4, 4, 2]
    assert conversation_turns(1) == [1]
    assert all(sum(conversation_turns(n)) == n for n in range(1, 50))


def test_a_reader_that_leaves_stops_the_command_without_a_traceback() -> None:
    code = (
        "import thunderagent.cli.main as m\n"
        "def closed(args): raise BrokenPipeError(32, 'Broken pipe')\n"
        "m._cmd_schemas = closed\n"
        "m.main(['schemas'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr == ""


def test_sched_params_reach_the_stacks_scheduler_and_bad_ones_stop_up(capsys) -> None:
    from thunderagent.stack.arguments import add_stack_arguments
    from thunderagent.stack.up import StackConfig

    p = argparse.ArgumentParser()
    add_stack_arguments(p)
    args = p.parse_args(["--sched-param", "cold_shared_hits=true", "--sched-param", "order=fcfs"])
    assert StackConfig.from_args(args).scheduler_args == [
        "--param=cold_shared_hits=true",
        "--param=order=fcfs",
    ]
    for item, words in [
        ("nope=1", "scheduler 'thunder' has no parameter 'nope'"),
        (
            "cold_shared_hits=maybe",
            "scheduler param cold_shared_hits='maybe': must be true or false",
        ),
        ("order", "'order': expected FIELD=VALUE"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["up", "--sched-param", item])
        assert info.value.code == 2
        assert f"thunderagent up: error: --sched-param {words}" in capsys.readouterr().err
