"""Optional TLS on the data plane: mutual TLS against the cluster CA, then the HMAC challenge."""

from __future__ import annotations

import datetime

import pytest

from ckptcache.server.cluster.dataplane import (
    DataPlaneClient,
    DataPlaneServer,
    PeerRefused,
    TLSConfig,
)
from tests.e2e.cluster.test_cluster import state
from tests.helpers import assert_same, wait_until


def make_pki(tmp_path):
    """A CA and one certificate it signed (used by every node of the test cluster)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("ckptcache-ca")).issuer_name(name("ckptcache-ca"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("node")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(ca_key, hashes.SHA256()))  # fmt: skip
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp_path / "node.pem").write_bytes(cert.public_bytes(pem))
    (tmp_path / "node.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    return TLSConfig(
        str(tmp_path / "node.pem"), str(tmp_path / "node.key"), str(tmp_path / "ca.pem")
    )


def test_backup_copies_over_mutual_tls(cluster_factory, tmp_path):
    tls = make_pki(tmp_path)
    a, b = cluster_factory(
        2, config=f"tls_cert: {tls.cert}\ntls_key: {tls.key}\ntls_ca: {tls.ca}\n"
    )
    path = tmp_path / "over-tls.pt"
    with a.client() as ca:
        ca.save(state(3), path, durability="backup")
    with b.client() as cb:
        assert_same(state(3), cb.load(path, verify=True))
    addr = next(line.split("data plane ")[1].rstrip(")") for line in a.log().splitlines()
                if "data plane" in line)  # fmt: skip
    with pytest.raises(PeerRefused):  # right secret, no TLS: the server wants a TLS hello
        DataPlaneClient(addr, b"s3cret", timeout=10)
    with DataPlaneClient(addr, b"s3cret", timeout=10, tls=tls) as ok:  # the real thing
        assert ok.sock.version() is not None  # a TLS session carried the challenge


def test_tls_connections_are_released_after_use(tmp_path):
    """Connection bounds count TLS connections once and free them when they end."""
    tls = make_pki(tmp_path)
    server = DataPlaneServer("127.0.0.1:0", b"k", {}, tls=tls, node_id="srv")
    server.start()
    try:
        for _ in range(3):
            with DataPlaneClient(server.address, b"k", 10, tls, node_id="c", expect="srv"):
                pass
        wait_until(lambda: not server._active and not server._pending)
    finally:
        server.close()
