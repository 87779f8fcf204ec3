"""The address a rank of the worker pool advertises to the others, and whether they can reach it.

Gloo binds and advertises, per rank: the first address of the network interface that
`GLOO_SOCKET_IFNAME` names; else the first address this machine's hostname resolves to that it
can bind; else 127.0.0.1 (torch's `ProcessGroupGloo::createDefaultDevice`). NCCL's bootstrap
reads `NCCL_SOCKET_IFNAME` the same way. Debian and Ubuntu map the hostname to 127.0.1.1 in
/etc/hosts, so there a rank advertises loopback, which ranks on other machines cannot reach, and a
pool over several machines never forms. `--pool-interface NAME` sets both variables for every
rank; a multi-machine pool whose rank would advertise loopback is refused, in one line, before
anything waits for it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

import psutil

from .store_json import StoreJson

INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_FALLBACK = "127.0.0.1"  # gloo's, where the hostname resolves to no address it can bind


class NoSuchInterface(ValueError):
    """The interface named for the pool does not exist here, or has no IP address."""


@dataclass(frozen=True)
class Advertised(StoreJson):
    address: str
    source: str  # how gloo picks it: "interface eth0", "hostname node-b", "hostname node-b does not resolve"
    host: str  # the machine's hostname

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address.split("%")[0]).is_loopback

    def __str__(self) -> str:
        return f"{self.address} ({self.source})"


def use_interface(name: str) -> None:
    """Gloo and NCCL of this process (and of the processes it starts) bind to interface `name`."""
    for var in INTERFACE_VARS:
        os.environ[var] = name


def advertised_address() -> Advertised:
    """What gloo advertises for a rank started with this process's environment on this machine."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    host = socket.gethostname()
    if interface:
        return Advertised(interface_address(interface), f"interface {interface}", host)
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return Advertised(LOOPBACK_FALLBACK, f"hostname {host} does not resolve", host)
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
            except OSError:
                continue
        return Advertised(sockaddr[0], f"hostname {host}", host)
    return Advertised(LOOPBACK_FALLBACK, f"hostname {host} resolves to no address of this machine", host)


def interface_address(name: str) -> str:
    """The interface's first IP address, in the order gloo takes it (getifaddrs')."""
    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise NoSuchInterface(f"this machine has no network interface {name} (it has {', '.join(sorted(addrs))})")
    for a in addrs[name]:
        if a.family in (socket.AF_INET, socket.AF_INET6):
            return a.address
    raise NoSuchInterface(f"network interface {name} has no IP address")


def address_problem(who: str, setting: str, *, multi_machine: bool) -> str | None:
    """One line saying why the pool's other ranks could not reach the address `who` (a rank, a
    machine) would advertise, and what to set (`setting`: the flag that names the interface);
    None when it will do."""
    try:
        mine = advertised_address()
    except NoSuchInterface as e:
        return f"{setting} {os.environ.get('GLOO_SOCKET_IFNAME')}: {e}"
    if multi_machine and mine.loopback:
        return loopback_line(who, mine, setting)
    return None


def loopback_line(who: str, mine: Advertised, setting: str) -> str:
    fix = f"give {setting} NAME, the network interface the machines reach each other on (it sets GLOO_SOCKET_IFNAME " \
          "and NCCL_SOCKET_IFNAME)"
    if not mine.source.startswith("interface"):
        fix += f", or map {mine.host} to that interface's address in /etc/hosts"
    return (f"{who} would advertise {mine} to the worker pool, a loopback address that ranks on other machines "
            f"cannot reach: {fix}")
