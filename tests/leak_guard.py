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


def child_processes() -> list[psutil.Process]:
    """This process's live descendants."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid}"


def is_server(p: psutil.Process) -> bool:
    """A hosted-tinker server (`python -m hosted_tinker serve ...`)."""
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return False
    return "hosted_tinker" in cmd and "serve" in cmd


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
