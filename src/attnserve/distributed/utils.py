"""Small helpers of the distributed layer: exact division, free ports, init methods."""

from __future__ import annotations

import socket


def divide(numerator: int, denominator: int) -> int:
    """`numerator / denominator`; ValueError unless it divides exactly."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def get_open_port() -> int:
    """A TCP port that is free now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def get_ip() -> str:
    """This host's address as other hosts see it (loopback when there is no route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("8.8.8.8", 80))  # UDP: no packet is sent
            address: str = sock.getsockname()[0]
            return address
        except OSError:
            return "127.0.0.1"


def get_distributed_init_method(ip: str, port: int) -> str:
    return f"tcp://{ip}:{port}"
