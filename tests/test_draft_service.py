"""draft_service/service.py's process set-up: ``--nice`` lowers the CPU priority of every thread
of the service's process, those started before it too (Linux keeps a niceness per thread)."""

import subprocess
import sys

import pytest
from pydantic import ValidationError

from draft_service.settings import DraftSettings

CHILD = """
import os, threading
from draft_service.service import lower_priority
started = threading.Event()
early = threading.Thread(target=started.wait, daemon=True)  # a thread started before, as at import
early.start()
lower_priority(7)
later = threading.Thread(target=started.wait, daemon=True)
later.start()
print(sorted({os.getpriority(os.PRIO_PROCESS, int(task)) for task in os.listdir("/proc/self/task")}))
started.set()
"""


def test_every_thread_runs_at_the_niceness_asked_for():
    niceness = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    assert niceness.strip() == "[7]"


@pytest.mark.parametrize("nice", [-1, 20])
def test_a_niceness_outside_0_to_19_is_refused(nice):
    with pytest.raises(ValidationError, match="nice"):
        DraftSettings(port=0, nice=nice)
