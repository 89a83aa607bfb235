"""The server's listening sockets (gRPC, HTTP, metrics): a port that cannot be opened is one line
naming its flag and the fix. Standard library only."""
from __future__ import annotations

import errno
import socket

# what to do about a port in use, by the flag that chose it
_FIXES = {"--port": "pass another port, or 0 for any free one",
          "--http-port": "pass another port, 0 for any free one, or off",
          "--metrics-port": "pass another port, or 0 for no metrics endpoint"}


# what each port's flag serves, at length and in short
_SERVES = {"--port": ("gRPC", "gRPC"), "--http-port": ("HTTP, OpenAI API", "HTTP"),
           "--metrics-port": ("Prometheus metrics", "metrics")}
_ANY_HOST = ("", "::", "0.0.0.0")


def same_port(listeners: list[tuple[str, str, int | None]]) -> str | None:
    """The line saying that two of (flag, host, port) would listen on the same port (0 or None: any free
    one, or none), before either binds: else the second would find its port in use by the first."""
    for i, (flag, host, port) in enumerate(listeners):
        for other, other_host, other_port in listeners[i + 1:]:
            if port and port == other_port and _overlap(host, other_host):
                line = (f"{flag} {port} ({_SERVES[flag][0]}) and {other} {port} ({_SERVES[other][0]}) are the same "
                        f"port: pagoda serves {_SERVES[flag][1]} on {flag} and {_SERVES[other][1]} on {other}; give "
                        f"them different ports")
                if (flag, other) == ("--port", "--http-port"):  # vLLM's --port is its HTTP API's
                    line += " (vLLM's --port is pagoda's --http-port, default 8000)"
                return line
    return None


def _overlap(a: str, b: str) -> bool:
    a, b = a.strip("[]"), b.strip("[]")
    return a == b or a in _ANY_HOST or b in _ANY_HOST


def cannot_listen(flag: str, host: str, port: int, error: OSError) -> str:
    fix = _FIXES.get(flag, "pass another port")
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is in use ({flag}): {fix}"
    if error.errno == errno.EACCES:
        return f"port {port} needs privileges to listen on ({flag}): pass a port from 1024 up, or 0 for any free one"
    host_flag = "--metrics-host" if flag == "--metrics-port" else "--host"
    return f"cannot listen on {host}:{port} ({host_flag}, {flag}): {error.strerror or error}"


def bound_socket(host: str, port: int, flag: str) -> socket.socket:
    """A TCP socket bound to host:port ("[::]" or "::": every interface, IPv4 too), not yet
    listening; OSError with cannot_listen's line."""
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if family == socket.AF_INET and not host.replace(".", "").isdigit():  # a name: take what it resolves to
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(cannot_listen(flag, host, port, e)) from e
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(cannot_listen(flag, host, port, e)) from e
    return sock


def check_free(host: str, port: int, flag: str) -> None:
    """Raises bound_socket's OSError if host:port cannot be listened on now. Before gRPC binds it:
    gRPC's C-core would first log its own lines (and its error names no flag)."""
    if port:
        bound_socket(host, port, flag).close()
