"""Certificates made for a test with the `openssl` command: a certificate
authority of the test's own and a server certificate it signs for 127.0.0.1,
as an operator running workers on a private CA would have."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple

VALIDITY_DAYS = 2
CURVE = "prime256v1"  # EC keys: made in milliseconds, unlike RSA
SERVER_EXTENSIONS = """subjectAltName = IP:127.0.0.1, DNS:localhost
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


class ServerCertificate(NamedTuple):
    ca_bundle: Path  # what a client must trust
    certificate: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_server_certificate(folder: Path, name: str) -> ServerCertificate:
    """A CA called `name` and a certificate for 127.0.0.1 signed by it."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, request, certificate = (f"{name}-{part}" for part in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem"))
    new_key = ("-newkey", "ec", "-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-nodes")
    _openssl("req", "-x509", *new_key, "-keyout", ca_key, "-out", ca, "-days", str(VALIDITY_DAYS),
             "-subj", f"/CN={name} test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-addext", "subjectKeyIdentifier=hash", cwd=folder)
    _openssl("req", *new_key, "-keyout", key, "-out", request, "-subj", "/CN=127.0.0.1", cwd=folder)
    (folder / f"{name}-server.ext").write_text(SERVER_EXTENSIONS)
    _openssl("x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", certificate,
             "-days", str(VALIDITY_DAYS), "-extfile", f"{name}-server.ext", cwd=folder)
    return ServerCertificate(folder / ca, folder / certificate, folder / key)
