"""Ctrl-C in the command line tool before a command handles it (its imports, its checks): one
line and exit code 130, not a traceback."""

from __future__ import annotations

from pdserve import cli


def test_ctrl_c_before_a_command_handles_it_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_client", interrupted)
    assert cli.main(["generate", "hello"]) == 130
    err = capsys.readouterr().err
    assert err == "pdserve: interrupted\n"
