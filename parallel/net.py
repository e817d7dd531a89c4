"""Plain network helpers that any layer may use: no torch, no engine.

`is_loopback(host)` decides whether an address names this machine only: servers bind there without an API key, and a
local gloo world keeps its sockets on the loopback interface.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (localhost, 127.0.0.0/8, ::1): the one bind allowed without a key."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
