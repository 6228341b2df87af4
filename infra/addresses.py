"""Network addresses as settings write them: a host with or without a port, IPv6 in brackets."""

from __future__ import annotations

from lambdalake.errors import ConfigurationError


def host_port(address: str, default_port: int) -> tuple[str, int]:
    """A ``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or bare IPv6 address as (host without
    brackets, port; ``default_port`` where none is given).

    Raises:
        ConfigurationError: The port is not a number.
    """
    text = address.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:  # a bare name, or a bare IPv6 address (several colons, no port)
        host, port = text, ""
    if port and not port.isdigit():
        raise ConfigurationError(
            f"the address {address!r} has a port that is not a number ({port!r})",
            fix="write it as host:port, or [ipv6]:port",
        )
    return host or "127.0.0.1", int(port) if port else default_port


def joined(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
