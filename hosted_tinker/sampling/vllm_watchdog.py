"""vLLM's parent-death watchdog: runs vLLM's command as its child, and SIGKILLs their whole process
group once the server that launched them is gone, however it died (kill -9 included).

`VLLMSidecar` starts it as the leader of vLLM's process group, with the read end of a pipe whose
only write end the server holds and never writes to: end of file on it means the server process
is gone. Why not `prctl(PR_SET_PDEATHSIG)`: it reaches only the process that sets it, not vLLM's
engine core and workers (separate processes of the group), and it fires when the *thread* that
spawned the child ends, not the process: a pipe's end of file is the process's death, and a
`killpg` takes the whole group.

Otherwise it stands in for vLLM: the server's stop sends SIGTERM to the whole group, which the
watchdog ignores while vLLM shuts its engine down; it then ends the way vLLM did (its exit code,
or the same signal), so the server sees vLLM's own exit.

Standard library only: it runs on vLLM's interpreter, without hosted_tinker on its path.
Usage: python vllm_watchdog.py FD -- COMMAND...
"""

import os
import signal
import subprocess
import sys
import threading


def _watch_parent(fd: int) -> None:
    while os.read(fd, 1):  # nobody writes: this returns b"" when the last write end closes
        pass
    os.killpg(0, signal.SIGKILL)  # vLLM, its engine processes, and this watchdog


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: vllm_watchdog.py FD -- COMMAND...\n")
        return 2
    # A handler, not SIG_IGN: exec resets handled signals to their default, so vLLM still gets SIGTERM.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    child = subprocess.Popen(argv[3:])
    threading.Thread(target=_watch_parent, args=(int(argv[1]),), daemon=True).start()
    code = child.wait()
    if code < 0:  # end by vLLM's signal, as the server would have seen vLLM end without us
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
