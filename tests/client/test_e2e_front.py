"""The port end to end (streamsvc/door/front.py behind the real server, tiny preset on CPU): a stream played over wss://
with a certificate made here, /metrics on --metrics-port, bad request targets on the server with its player."""

import asyncio
import datetime
import ipaddress
import logging
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from client.viewer import ClientConfig, ClientState
from client.ws_client import StreamClient
from streamsvc.door.access import AccessConfig
from tests.client.servers import running

T = 10.0  # generous bound for anything that should take well under a second
STATIC = Path(__file__).resolve().parents[2] / "client" / "static"


def self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (cert file, key file). With the
    `cryptography` package, else the openssl command; the test is skipped with neither."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor the openssl command is here to make a certificate")
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True,
                       timeout=60)
        return str(cert), str(key)
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                    x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(cert), str(key)


def status(url: str, headers: dict | None = None, context: ssl.SSLContext | None = None) -> int:
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=T, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def test_a_stream_plays_over_wss_on_the_same_port_with_a_self_signed_certificate(tmp_path, caplog):
    cert, key = self_signed(tmp_path)
    caplog.set_level(logging.INFO, logger="streamsvc.server")
    async with running(tls_cert=cert, tls_key=key) as server:
        assert f"serving on https://127.0.0.1:{server.port}" in caplog.text
        url = f"wss://127.0.0.1:{server.port}/ws"
        for options in ({"ca_file": cert}, {"insecure": True}):
            async with StreamClient(url, ClientConfig(prompt="a red fox in the snow", seed=1, **options)) as c:
                assert c.state is ClientState.PLAYING, c.errors
                assert await c.wait_until(lambda: c.chunks >= 2, T), c.errors
            assert c.result().frames_decoded > 0 and c.result().errors == ()
        untrusted = StreamClient(url, ClientConfig(prompt="no", open_timeout_s=5))
        assert not await untrusted.open()
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.errors[0]
        await untrusted.close()
        plain = StreamClient(f"ws://127.0.0.1:{server.port}/ws", ClientConfig(prompt="no", open_timeout_s=5))
        assert not await plain.open()  # no plain ws on a TLS port
        await plain.close()
        context = ssl.create_default_context(cafile=cert)
        healthz = f"https://127.0.0.1:{server.port}/healthz"
        assert await asyncio.to_thread(status, healthz, None, context) == 200


async def test_metrics_port_serves_metrics_alone_without_the_token_and_the_main_port_has_none():
    from client.loadtest import free_port

    port = free_port()
    async with running(access=AccessConfig(tokens={"tok": None}), metrics_port=port) as server:
        main = f"http://127.0.0.1:{server.port}"
        assert await asyncio.to_thread(status, main + "/metrics", {"Authorization": "Bearer tok"}) == 404
        assert await asyncio.to_thread(status, main + "/healthz") == 200
        assert await asyncio.to_thread(status, f"http://127.0.0.1:{port}/metrics") == 200
        assert await asyncio.to_thread(status, f"http://127.0.0.1:{port}/healthz") == 404
    async with running(access=AccessConfig(tokens={"tok": None})) as server:  # no metrics port: behind the token
        main = f"http://127.0.0.1:{server.port}/metrics"
        assert await asyncio.to_thread(status, main) == 401
        assert await asyncio.to_thread(status, main, {"Authorization": "Bearer tok"}) == 200


async def test_a_nul_in_the_target_is_a_400_on_the_server_with_its_player_and_no_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    async with running(static_dir=str(STATIC)) as server:
        for target in (b"/\x00", b"/%00", b"/index.html%00.js", b"/recordings/%00", b"/" + b"%2e%2e/" * 5 + b"etc"):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), T)
            writer.close()
            assert answer.split(b" ", 2)[1] in (b"400", b"404"), (target, answer[:80])
        assert await asyncio.to_thread(status, f"http://127.0.0.1:{server.port}/") == 200  # the player still
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info]
