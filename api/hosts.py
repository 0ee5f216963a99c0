"""Which ``Host`` a server without a token answers (DNS rebinding).

A page on another site cannot read a loopback server's answers, unless its own name comes
to resolve to that server's address (DNS rebinding): the browser then sends the page's
name as ``Host``. A server that asks for no token therefore answers only a ``Host`` that
names it: the address it is bound to, a loopback name (``localhost``, ``*.localhost``), an
IP address (a page served from an address is that server's own origin), or a name of
``--allowed-hosts`` (``*`` allows any). A request without ``Host`` (HTTP/1.0, no browser)
passes. A server with tokens answers any ``Host``: a rebound page has no token to send.
webpack-dev-server's ``allowedHosts: "auto"`` draws the same line.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

ANY = "*"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain"})
_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})
_SEEN_MAX = 256  # Host values whose answer a rule keeps (a client may send any)


def host_name(value: bytes | str) -> str:
    """The name of a ``Host`` value, lower case, without port, brackets or final dot."""
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip().lower()
    if text.startswith("["):  # [v6] or [v6]:port
        return text[1 : text.find("]")] if "]" in text else text[1:]
    if text.count(":") == 1:
        text = text.partition(":")[0]
    return text.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostRule:
    """The ``Host`` names a server without a token answers.

    Args:
        bound: the address the server listens on (``--host``).
        allowed: more names (``--allowed-hosts``); ``*`` allows every ``Host``.
    """

    def __init__(self, bound: str, allowed: Iterable[str] = ()) -> None:
        names = {host_name(n) for n in allowed if n.strip()}
        self.any = ANY in names
        bound_name = host_name(bound)
        if bound_name not in _ANY_ADDRESS:
            names.add(bound_name)
        self.names = frozenset(names | _LOOPBACK_NAMES)
        self._seen: dict[bytes | str, bool] = {}  # Host values answered before

    def allows(self, host: bytes | str | None) -> bool:
        """Whether a request with this ``Host`` value (None: without one) is answered."""
        if host is None or self.any:
            return True
        seen = self._seen.get(host)
        if seen is None:
            name = host_name(host)
            seen = name in self.names or name.endswith(".localhost") or _is_address(name)
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen[host] = seen
        return seen

    def describe(self, host: bytes | str) -> str:
        """The refusal's message for ``host``."""
        return (
            f"rule 'a server without a token answers only a Host naming it (its address, "
            f"a loopback name, an IP address, or --allowed-hosts)' failed: found "
            f"{host_name(host)!r}; add it with --allowed-hosts, or give the server a token"
        )
