"""The Ray token never leaves for another machine in clear without a warning: `tidal submit` (and
every command that talks to the Jobs API) says once when it would send it over plain http."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import free_port
from tidal.cli import main
from tidal.launch import connect as connect_module
from tidal.launch.connect import plain_token_warning, warn_plain_token


@pytest.mark.parametrize(("address", "has_token", "warns"), [
    ("http://10.0.0.10:8265", True, True),       # the head's private address, in clear
    ("head.example.com:8265", True, True),       # no scheme: Ray's client uses http
    ("http://10.0.0.10:8265", False, False),     # no token, nothing to leak
    ("https://ray.example.com", True, False),    # TLS proxy on the head
    ("http://127.0.0.1:8265", True, False),      # the local end of `ray dashboard` (SSH) or this machine
    ("http://localhost:8265", True, False),
    ("http://[::1]:8265", True, False),
])
def test_plain_token_warning(address: str, has_token: bool, warns: bool):
    message = plain_token_warning(address, has_token)
    assert (message is not None) == warns
    if warns:
        assert address in message and "ray dashboard" in message and "https://" in message


def test_warned_once_per_address(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(connect_module, "_warned", set())
    for _ in range(3):
        warn_plain_token("http://10.0.0.10:8265", True)
    warn_plain_token("http://10.0.0.11:8265", True)
    err = capsys.readouterr().err
    assert err.count("10.0.0.10:8265 over plain http") == 1 and err.count("10.0.0.11:8265") == 1


def own_address() -> str | None:
    """This machine's first non-loopback address: a real 'remote' head that refuses at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.254", 9))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_cli_warns_when_the_token_goes_in_clear(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    ip = own_address()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    monkeypatch.setattr(connect_module, "_warned", set())
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t0ken")
    address = f"http://{ip}:{free_port()}"  # nobody listens there: the command fails after the warning
    assert main(["list", "--address", address]) != 0
    err = capsys.readouterr().err
    assert f"the Ray token goes to {address} over plain http" in err
    assert "t0ken" not in err
    assert main(["list", "--address", f"http://127.0.0.1:{free_port()}"]) != 0  # a tunnel's end: no warning
    assert "plain http" not in capsys.readouterr().err
