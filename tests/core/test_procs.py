"""Killing only one's own processes: a record is a PID *and* a start time (issue 58 item 9).

bench/soak.py used to SIGKILL, at its end, every PID it had ever seen that existed then; after
thousands of runners PIDs come round again, and as root that kills other people's processes.
It now records the manager's descendants with their start times (``procs.descendants``) and
signals a record only while it is still that process (``procs.signal_recorded``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from jupyter_llama.procs import descendants, process_alive, signal_recorded, start_time

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def sleeper():
    """``sh`` running a ``sleep`` of its own: (the shell, the sleep's PID), both ended after."""
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(sh.stdout.readline())
    started = start_time(grandchild)
    yield sh, grandchild
    signal_recorded(grandchild, started, signal.SIGKILL)  # (by its record too: its PID could be anyone's by now)
    sh.kill()
    sh.wait(10)
    sh.stdout.close()


def test_descendants_are_recorded_with_their_start_times(sleeper):
    sh, grandchild = sleeper
    mine = descendants(os.getpid())
    assert mine[sh.pid] == start_time(sh.pid) is not None
    assert mine[grandchild] == start_time(grandchild) is not None
    assert descendants(sh.pid) == {grandchild: mine[grandchild]}  # the shell's: its sleep, not itself
    assert os.getpid() not in mine and os.getppid() not in mine
    assert descendants(grandchild) == {}


def test_only_a_record_that_is_still_the_process_is_signalled(sleeper):
    sh, grandchild = sleeper
    started = descendants(sh.pid)[grandchild]
    # a wrong start time (the PID handed to another process since) or none at all: not matched
    for wrong in (started + 1, started - 1, None):
        assert signal_recorded(grandchild, wrong, signal.SIGKILL) is False
    assert process_alive(grandchild) and process_alive(sh.pid)
    # the right record is signalled, and the process ends
    assert signal_recorded(sh.pid, start_time(sh.pid), 0) is True  # (signal 0: only asks)
    assert signal_recorded(grandchild, started, signal.SIGKILL) is True
    sh.wait(10)  # the shell's wait returns once its sleep is killed and reaped
    assert not process_alive(grandchild)
    assert signal_recorded(grandchild, started, signal.SIGKILL) is False  # gone: nothing is sent


def test_a_record_of_a_process_that_ended_is_not_matched():
    p = subprocess.Popen(["sleep", "60"])
    started = start_time(p.pid)
    p.kill()
    p.wait(10)
    assert signal_recorded(p.pid, started, signal.SIGKILL) is False
    assert p.pid not in descendants(os.getpid())
