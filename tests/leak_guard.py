"""What a test module may not leave behind: SDK clients still heartbeating, and server processes.

conftest.py checks both after every module and everything (any child process) after the
session, so that CI fails on a leak instead of on the interpreter abort it can cause later.
"""

from __future__ import annotations

import asyncio

import psutil

HEARTBEAT = "InternalClientHolder._session_heartbeat"  # the SDK's per-client heartbeat coroutine


def open_sdk_sessions(*, stop: bool = False) -> list[str]:
    """Session ids of tinker SDK clients whose heartbeat still runs: a ServiceClient not closed.
    With `stop`, those heartbeats are cancelled too (after a leak is reported, so that it does
    not go on into the tests that follow).

    Every client runs its heartbeat as a task on the SDK's one background event loop; the loop
    is asked for its tasks (from the loop itself: its task set is not thread-safe)."""
    from tinker.lib.internal_client_holder import _internal_client_holder_thread_singleton as sdk_thread

    loop = sdk_thread.loop_if_started()
    if loop is None or not loop.is_running():
        return []

    async def beating() -> list[str]:
        tasks = [t for t in asyncio.all_tasks()
                 if not t.done() and getattr(t.get_coro(), "__qualname__", "") == HEARTBEAT]
        if stop:
            for t in tasks:
                t.cancel()
        return [str(t.get_coro().cr_frame.f_locals.get("session_id")) if t.get_coro().cr_frame else "?"
                for t in tasks]

    return asyncio.run_coroutine_threadsafe(beating(), loop).result(timeout=60)


def forget_rest_clients_keyed_by_environment() -> int:
    """Close and forget the SDK's session-less clients that read their API key from $TINKER_API_KEY.

    tinker 0.38 keeps one session-less client per (base URL, API key) for the life of the process
    (`sessionless_holder_cache`): `RestClient(base_url=...)` with no api_key, as the cookbook's
    `weights.download` makes it, is cached under the key None and keeps whatever $TINKER_API_KEY was
    when it was first made. A test that sets another $TINKER_API_KEY for the same server would
    otherwise act as the earlier test's key (a 404 on its own checkpoints). Run after every test.
    Returns how many were forgotten."""
    from tinker.lib.internal_client_holder import sessionless_holder_cache as cache

    with cache._lock:
        stale = [cache._holders.pop(key) for key in [k for k in cache._holders if k[1] is None]]
    for holder in stale:
        holder.close()
    return len(stale)


def child_processes() -> list[psutil.Process]:
    """This process's live descendants, less multiprocessing's resource tracker and fork server:
    the interpreter starts the tracker itself the first time anything (torch's shared memory, a
    semaphore) needs it, and server_process.py the fork server on the first server it forks; both
    live as long as this process and end with it, so they are nobody's leak."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not is_resource_tracker(p) and not is_fork_server(p):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def is_resource_tracker(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker of this very interpreter (its direct child)."""
    try:
        return p.ppid() == psutil.Process().pid and "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def is_fork_server(p: psutil.Process) -> bool:
    """multiprocessing's fork server of this very interpreter (its direct child), which forks servers."""
    try:
        return p.ppid() == psutil.Process().pid and _FORK_SERVER in " ".join(p.cmdline())
    except psutil.Error:
        return False


_FORK_SERVER = "multiprocessing.forkserver"


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid}"


def is_server(p: psutil.Process) -> bool:
    """A hosted-tinker server: `python -m hosted_tinker serve ...`, or one forked by the fork server
    (it has the fork server's command line; the fork server forks nothing else)."""
    try:
        cmd = p.cmdline()
        forked = _FORK_SERVER in " ".join(cmd) and p.ppid() != psutil.Process().pid
    except psutil.Error:
        return False
    return forked or ("hosted_tinker" in cmd and "serve" in cmd)


def end(processes: list[psutil.Process]) -> None:
    """Terminate leaked processes (after reporting them), so that they do not slow what follows."""
    for p in processes:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=30)
    for p in alive:
        p.kill()
