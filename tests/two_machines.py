"""Two "machines" for tests of a worker pool across machines: two Linux network namespaces joined
by a veth pair, each with its own address, hostname (a UTS namespace per process tree, `unshare
--uts`) and /etc/hosts (`ip netns exec` binds /etc/netns/<name>/hosts over /etc/hosts).

Nothing is added to the host's own network: the addresses live only inside the namespaces made
here, and `remove()` deletes the namespaces (their veth ends go with them) and their /etc/netns
folders. Making namespaces needs root (CAP_NET_ADMIN): `TwoMachines.unavailable()` says why it
cannot, for a skip.

A process inside a namespace listens there only; `PortForward` makes a port of one reachable at
127.0.0.1 of the test's own namespace (the SDK in the test talks to a server on machine A).
"""

from __future__ import annotations

import ctypes
import os
import selectors
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET = 0x40000000  # setns(2): enter a network namespace (the calling thread only)
INTERFACE = "ht0"  # each machine's end of the veth pair: the same name on both, as on twin hosts


@dataclass(frozen=True)
class Machine:
    netns: str
    hostname: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this machine: in its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.hostname, *argv]

    def write_hosts(self, text: str) -> None:
        """This machine's /etc/hosts, for the processes started after."""
        folder = Path("/etc/netns") / self.netns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(text)


class TwoMachines:
    """Machines A (10.213.0.1) and B (10.213.0.2), named after this process so that test runs side
    by side do not collide."""

    def __init__(self):
        tag = f"ht{os.getpid()}"
        self.a = Machine(f"{tag}a", "node-a", "10.213.0.1")
        self.b = Machine(f"{tag}b", "node-b", "10.213.0.2")

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "making network namespaces needs root (CAP_NET_ADMIN); CI runs these tests as root"
        missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
        return f"{' and '.join(missing)} not installed (iproute2, util-linux)" if missing else None

    def create(self) -> None:
        """Raises `RuntimeError` (with ip's message) where the kernel refuses."""
        try:
            for m in (self.a, self.b):
                _ip("netns", "add", m.netns)
            _ip("link", "add", INTERFACE, "netns", self.a.netns, "type", "veth", "peer", "name", INTERFACE,
                "netns", self.b.netns)
            for m in (self.a, self.b):
                _ip("-n", m.netns, "addr", "add", f"{m.address}/24", "dev", INTERFACE)
                _ip("-n", m.netns, "link", "set", INTERFACE, "up")
                _ip("-n", m.netns, "link", "set", "lo", "up")
        except RuntimeError:
            self.remove()
            raise

    def remove(self) -> None:
        for m in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", m.netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / m.netns, ignore_errors=True)


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class PortForward:
    """127.0.0.1:`port` here -> 127.0.0.1:`port` inside network namespace `netns`. Each connection
    gets a thread that enters the namespace (setns(2) moves only the calling thread), opens the
    connection there and copies bytes both ways until either side closes."""

    def __init__(self, netns: str, port: int):
        self.netns, self.port = netns, port
        self.listener = socket.create_server(("127.0.0.1", port))
        self._closed = False
        threading.Thread(target=self._accept, name=f"forward:{port}", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        with client:
            fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    return
            finally:
                os.close(fd)
            try:
                upstream = socket.create_connection(("127.0.0.1", self.port))
            except OSError:  # nothing listens there (yet): the client sees the connection close
                return
            with upstream, selectors.DefaultSelector() as sel:
                sel.register(client, selectors.EVENT_READ, upstream)
                sel.register(upstream, selectors.EVENT_READ, client)
                while not self._closed:
                    for key, _ in sel.select(timeout=1.0):
                        data = key.fileobj.recv(65536)
                        if not data:
                            return
                        key.data.sendall(data)
