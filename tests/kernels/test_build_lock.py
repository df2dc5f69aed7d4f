"""The kernels' build: its name follows its sources, a lock file left by a killed loader no longer hangs
every later load, and a live loader is still waited for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from mili_openai.kernels.build_lock import (
    OWN_LOCK_NAME,
    TORCH_LOCK_NAME,
    build_directory,
    exclusive_build,
    extension_name,
)
from mili_openai.kernels.cpu import EXTENSION_PREFIX, HEADERS, QUANTIZED_SOURCES, SOURCE_DIR, SOURCES


def test_the_build_name_is_a_hash_of_every_source_and_header(tmp_path):
    (tmp_path / "a.cpp").write_text("int a;")
    (tmp_path / "b.h").write_text("// b")
    first = extension_name("ext", tmp_path)
    assert first.startswith("ext_") and extension_name("ext", tmp_path) == first
    (tmp_path / "notes.txt").write_text("not a source")
    assert extension_name("ext", tmp_path) == first
    (tmp_path / "b.h").write_text("// b, edited")  # a header torch's JIT would not see change
    edited = extension_name("ext", tmp_path)
    assert edited != first
    (tmp_path / "c.h").write_text("")  # a new header
    assert extension_name("ext", tmp_path) != edited


def test_the_kernels_name_covers_the_files_they_are_built_from():
    listed = set(SOURCES + QUANTIZED_SOURCES + HEADERS)
    in_dir = {path.name for path in SOURCE_DIR.iterdir() if path.suffix in (".cpp", ".h")}
    assert listed == in_dir  # a file in csrc that no list names would change the name yet not ship
    assert extension_name(EXTENSION_PREFIX, SOURCE_DIR).startswith(EXTENSION_PREFIX + "_")


def test_build_directory_follows_torch_extensions_dir_one_per_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    first = build_directory("ext_v1", tmp_path / "checkout_a" / "csrc")
    assert first.parent == tmp_path and first.name.startswith("ext_v1-")
    assert build_directory("ext_v1", tmp_path / "checkout_a" / "csrc") == first
    assert build_directory("ext_v1", tmp_path / "checkout_b" / "csrc") != first
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build_directory("ext_v1", tmp_path).parent.name == "mili-openai"


def test_lock_file_of_a_killed_loader_is_removed(tmp_path):
    # a loader that created torch's lock file and was killed: SIGKILL runs no cleanup
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from mili_openai.kernels.build_lock import exclusive_build
        with exclusive_build(Path({str(tmp_path)!r})):
            os.close(os.open({str(tmp_path / TORCH_LOCK_NAME)!r}, os.O_CREAT | os.O_EXCL))
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -9
    assert (tmp_path / TORCH_LOCK_NAME).exists()

    with exclusive_build(tmp_path):
        assert not (tmp_path / TORCH_LOCK_NAME).exists()
    assert (tmp_path / OWN_LOCK_NAME).exists()  # kept: only its flock matters


def test_a_live_loader_is_waited_for_not_robbed(tmp_path):
    torch_lock = tmp_path / TORCH_LOCK_NAME
    inside, events = threading.Event(), []

    def live_loader():
        with exclusive_build(tmp_path):
            torch_lock.touch()  # torch's FileBaton, held while it builds
            inside.set()
            time.sleep(0.5)
            events.append(("loader sees its lock", torch_lock.exists()))
            torch_lock.unlink()
            events.append(("loader done", None))

    thread = threading.Thread(target=live_loader)
    thread.start()
    assert inside.wait(timeout=10)
    with exclusive_build(tmp_path):  # a second open file description: blocks on the first one's flock
        events.append(("second loader in", None))
    thread.join(timeout=10)
    assert events == [("loader sees its lock", True), ("loader done", None), ("second loader in", None)]
