"""fork() while another thread holds the native thread pool's global lock.

Every kernel call takes that lock briefly with the GIL released. fork() copies only the calling
thread: without the pthread_atfork handlers in csrc/threadpool.cpp, a child forked while another
thread held it inherited it locked and hung in its first kernel call. The test hook
``_C._debug_hold_pool_lock`` holds the lock on a thread for a while, so the fork lands inside the
window every time. Runs in a subprocess so that a hang fails the test instead of the run.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SNIPPET = r"""
import os, threading, time
import torch
from offload import _C, kernels
H = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True)
t = threading.Thread(target=_C._debug_hold_pool_lock, args=(0.5,))
t.start()
time.sleep(0.1)  # the thread now holds the lock; fork waits for it (prepare handler)
pid = os.fork()
if pid == 0:
    p = torch.zeros(8)
    kernels.adam_step([p], [torch.ones(8)], [torch.zeros(8)], [torch.zeros(8)], None, [1], threads=1, **H)
    os._exit(0 if p.abs().sum() > 0 else 3)
deadline = time.monotonic() + 10.0
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("CHILD", os.waitstatus_to_exitcode(status))
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("CHILD HUNG")
        break
    time.sleep(0.01)
t.join()
"""


def test_child_forked_while_the_pool_lock_is_held_does_not_hang():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SNIPPET)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"fork test hung:\n{out}\n{err}")
    assert proc.returncode == 0, err
    assert "CHILD 0" in out, (out, err)
