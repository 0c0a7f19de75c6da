"""TLS on the front's ports, terminated by its HAProxy (tritonserver's --grpc-use-ssl family, and
the same for HTTP): tritonclient with ``ssl=True`` and certificates this test makes; mutual TLS
refuses a client without a certificate. A real HAProxy; the listeners of
tests/front_stand_ins.py as replicas."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port, infer, publish
from rayinfer.transport import front_supervisor
from rayinfer.deployments.front import Front
from rayinfer.transport.front_config import TlsSettings


def _certificate(name: str, key, issuer_key=None, issuer=None, ca: bool = False) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate and a client certificate it signs, as PEM files."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("rayinfer test CA", ca_key, ca=True)
    files = {"ca": folder / "ca.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = folder / f"{name}.pem"
        files[name].write_bytes(_certificate(name, key, ca_key, ca.subject).public_bytes(serialization.Encoding.PEM))
        files[f"{name}_key"] = folder / f"{name}-key.pem"
        files[f"{name}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return files


def _front(loop, certificates, mutual: bool) -> tuple[Front, Replica, int, int]:
    http_port, grpc_port = free_port(), free_port()
    tls = TlsSettings(str(certificates["server"]), str(certificates["server_key"]),
                      str(certificates["ca"]) if mutual else "", mutual)
    front = Front(("127.0.0.1", http_port, "127.0.0.1", free_port()), ("127.0.0.1", grpc_port, "127.0.0.1", free_port()),
                  "v2", direct=True, tls={"http": tls, "grpc": tls}, front_key=TEST_FRONT_KEY)
    assert not front.direct and not front.grpc_direct  # HAProxy terminates TLS: no acceptor on these ports
    replica = Replica(loop, "one")
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    return front, replica, http_port, grpc_port


def test_grpc_and_https_over_tls(loop, certificates):
    front, _, http_port, grpc_port = _front(loop, certificates, mutual=False)
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True,
                                                  root_certificates=str(certificates["ca"]))
        assert infer(client, "m", np.ones((1, 2), dtype=np.float32), request_id="tls").model_name == "one"
        client.close()
        https = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", ssl=True,
                                                 ssl_options={"ca_certs": str(certificates["ca"])})
        assert https.is_model_ready("m")
        https.close()
        # A client that does not speak TLS gets no answer.
        plain = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException):
            infer(plain, "m", np.ones((1, 2), dtype=np.float32))
        plain.close()
    finally:
        front.stop()


def test_mutual_tls_needs_a_client_certificate(loop, certificates):
    front, _, _, grpc_port = _front(loop, certificates, mutual=True)
    try:
        signed = grpcclient.InferenceServerClient(
            f"127.0.0.1:{grpc_port}", ssl=True, root_certificates=str(certificates["ca"]),
            private_key=str(certificates["client_key"]), certificate_chain=str(certificates["client"]))
        assert infer(signed, "m", np.ones((1, 2), dtype=np.float32)).model_name == "one"
        signed.close()
        anonymous = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True,
                                                     root_certificates=str(certificates["ca"]))
        with pytest.raises(InferenceServerException):
            infer(anonymous, "m", np.ones((1, 2), dtype=np.float32))
        anonymous.close()
    finally:
        front.stop()


def test_the_certificate_and_key_are_kept_for_this_user_only(loop, certificates):
    front, _, http_port, _ = _front(loop, certificates, mutual=False)
    try:
        folder = front_supervisor.running_front(("127.0.0.1", http_port))
        assert folder is not None
        pems = list(folder.glob("*-tls.pem"))
        assert sorted(p.name for p in pems) == ["grpc-tls.pem", "http-tls.pem"]
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in pems)
    finally:
        front.stop()
