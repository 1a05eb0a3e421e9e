"""``controller.priority``: a thread's OS scheduling class and OS name, per thread (Linux)."""

import os
import sys
import threading
from pathlib import Path

import pytest

from fuseflow.controller.priority import name_thread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread OS names are Linux's")


def _os_name(tid: int) -> str:
    return Path(f"/proc/self/task/{tid}/comm").read_text().strip()


def test_name_thread_names_only_the_calling_thread_and_keeps_15_bytes():
    main, seen = _os_name(threading.get_native_id()), {}

    def run():
        seen["ok"] = name_thread("decode-0-and-a-long-tail")
        seen["name"] = _os_name(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"ok": True, "name": "decode-0-and-a-"}  # the kernel keeps 15 bytes
    assert _os_name(threading.get_native_id()) == main  # the caller's own thread is untouched
    assert threading.get_native_id() == os.getpid()  # pytest runs tests on the main thread, ...
    assert not name_thread("renamed") and _os_name(os.getpid()) == main  # ... which keeps the process's name
