"""Where webhooks may go: the operator's allow-list, checked against every address a host resolves to.

The allow-list (MUONFORGE_WEBHOOK_ALLOW) holds networks, host names and ``public``. Without it, an
endpoint URL would let a tenant make the service POST to its database, a cloud metadata address or
any host of the internal network (server-side request forgery). The list is empty by default:
nothing is delivered until the operator says where deliveries may go. A host is resolved once per
attempt, each of its addresses checked, and the request made to the checked address: a second
lookup by the HTTP client could answer otherwise (DNS rebinding).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
PUBLIC = "public"  # every globally routable address (ipaddress's is_global): the internet, no private range
HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")
DEFAULT_PORTS = {"http": 80, "https": 443}
Lookup = Callable[[str, int], list[str]]


class NotAllowed(ValueError):
    """The URL is not one a webhook may be sent to (scheme, form, or an address outside the list)."""


class Unresolved(ValueError):
    """The URL's host name does not resolve (now): a later attempt may succeed."""


@dataclass(frozen=True)
class AllowList:
    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()
    public: bool = False

    @classmethod
    def parse(cls, text: str) -> AllowList:
        """``10.1.2.0/24, 127.0.0.1, hooks.example.com, public`` (comma-separated); ValueError names
        an entry that is none of these."""
        networks, hosts, public = [], set(), False
        for entry in (e.strip().lower() for e in text.split(",")):
            if not entry:
                continue
            if entry == PUBLIC:
                public = True
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                name = entry.rstrip(".")
                if not HOST_NAME.match(name) or name.rsplit(".", 1)[-1].isdigit():  # 10.0.0.300: no name
                    raise ValueError(
                        f"{entry!r} is neither a network (CIDR), an address, a host name nor {PUBLIC!r}"
                    ) from None
                hosts.add(name)
        return cls(tuple(networks), frozenset(hosts), public)

    def __bool__(self) -> bool:
        return bool(self.networks or self.hosts or self.public)

    def allows_address(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:10.0.0.1 reaches 10.0.0.1
        return (self.public and address.is_global) or any(address in network for network in self.networks)


@dataclass(frozen=True)
class Destination:
    """Where one attempt goes, and what keeps the request about the named host.

    ``url`` has its host replaced by the checked address; the Host header, and TLS's server name and
    certificate check, keep the named host.
    """

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)


def system_lookup(host: str, port: int) -> list[str]:
    """The host's addresses, as the system resolver gives them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolved(f"the host {host!r} does not resolve ({exc})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def parse_url(url: str, require_https: bool = False) -> httpx.URL:
    """The URL, if it has the form of a webhook destination: http(s) (https only, when required),
    a host, a valid port; else NotAllowed saying why."""
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise NotAllowed(f"not a valid URL ({exc})") from None
    schemes = ("https",) if require_https else ("http", "https")
    if parsed.scheme not in schemes:
        raise NotAllowed(f"the URL must start with {' or '.join(s + '://' for s in schemes)}")
    if not parsed.host:
        raise NotAllowed("the URL has no host")
    if port is not None and not 0 < port < 65536:
        raise NotAllowed(f"the port {port} is not a TCP port")
    return parsed


def resolve(url: str, allow: AllowList, require_https: bool = False, lookup: Lookup = system_lookup) -> Destination:
    """Check ``url`` against ``allow`` and say where to send it.

    A host named in the list is allowed whatever it resolves to (the operator vouches for it); any
    other host must resolve only to addresses the list allows. NotAllowed or Unresolved otherwise.
    """
    parsed = parse_url(url, require_https)
    if not allow:
        raise NotAllowed(
            "this server delivers webhooks nowhere yet: its operator must list the allowed destinations "
            "in MUONFORGE_WEBHOOK_ALLOW"
        )
    host = parsed.raw_host.decode("ascii").lower().rstrip(".")
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:  # no lookup: the URL names the address itself
        if not allow.allows_address(literal):
            raise NotAllowed(f"{literal} is outside the destinations this server delivers to")
        return Destination(str(parsed))
    addresses = lookup(host, parsed.port or DEFAULT_PORTS[parsed.scheme])
    if not addresses:
        raise Unresolved(f"the host {host!r} has no address")
    if host not in allow.hosts:
        refused = [a for a in addresses if not allow.allows_address(ipaddress.ip_address(a.split("%")[0]))]
        if refused:
            outside = f"{host} resolves to {', '.join(refused)}"
            raise NotAllowed(f"{outside}, outside the destinations this server delivers to")
    return Destination(
        str(parsed.copy_with(host=addresses[0])),
        headers={"Host": parsed.netloc.decode("ascii")},
        extensions={"sni_hostname": host} if parsed.scheme == "https" else {},
    )
