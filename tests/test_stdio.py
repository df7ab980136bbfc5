"""A command's stdout carries its own output alone (xfer._stdio.own_stdout): what a C library
writes to fd 1 (Gloo's "[Gloo] Rank 1 is connected to 1 peer ranks"), Python prints and child
processes go to stderr, and stdout is whole again afterwards."""

import subprocess
import sys
import textwrap

import pytest

from xfer._stdio import own_stdout

SNIPPET = textwrap.dedent("""
    import ctypes, os, subprocess, sys
    from xfer._stdio import own_stdout

    print("before", flush=True)
    with own_stdout() as out:
        os.write(1, b"[Gloo] Rank 1 is connected to 1 peer ranks\\n")      # a C library on fd 1
        libc = ctypes.CDLL(None)
        libc.puts(b"[Gloo] from libc puts"); libc.fflush(None)
        print("a python print")
        subprocess.run([sys.executable, "-c", "print('a child process')"], check=True)
        out.write('{"doc": 1}\\n')
    print("after", flush=True)
""")


def test_only_the_document_reaches_stdout():
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == 'before\n{"doc": 1}\nafter\n'
    for noise in ("[Gloo] Rank 1 is connected", "[Gloo] from libc puts", "a python print", "a child process"):
        assert noise in r.stderr


def test_captured_stdout_is_yielded_as_is(capsys):
    with own_stdout() as out:
        out.write("table\n")
        print("noise")
    print("after")
    got = capsys.readouterr()
    assert got.out == "table\nafter\n"
    assert got.err == "noise\n"


@pytest.mark.parametrize("raises", [False, True])
def test_stdout_restored_after_an_error(raises, capfd):
    try:
        with own_stdout() as out:
            out.write("doc\n")
            if raises:
                raise RuntimeError("boom")
    except RuntimeError:
        pass
    print("after", flush=True)
    assert sys.stdout is not sys.stderr
    assert capfd.readouterr().out.endswith("after\n")
