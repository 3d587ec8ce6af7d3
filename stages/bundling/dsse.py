"""DSSE envelopes of in-toto statements, signed with an EC P-256 key (deterministic ECDSA,
RFC 6979, so the same statement and key give the same bytes): what a stage run's
attestation is (pipelines/provenance.py) and what the bundle's own file list is
(stages/bundle.py, `attestations/bundle.json`)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

PAYLOAD_TYPE = "application/vnd.in-toto+json"


def pae(payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed."""
    kind = PAYLOAD_TYPE.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def key_id(public: Any) -> str:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    der = public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def ecdsa() -> Any:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.ECDSA(hashes.SHA256(), deterministic_signing=True)


def envelope(statement: dict[str, Any], key: Any) -> str:
    """The statement as a DSSE envelope (JSON text), signed when `key` is given."""
    payload = json.dumps(statement, sort_keys=True, separators=(",", ":")).encode()
    signatures = []
    if key is not None:
        signature = key.sign(pae(payload), ecdsa())
        signatures.append(
            {"keyid": key_id(key.public_key()), "sig": base64.b64encode(signature).decode()}
        )
    body = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": signatures,
    }
    return json.dumps(body, indent=2) + "\n"


KEY_ENV = "SHIPYARD_BUILDER_KEY"


def builder_key_from_env() -> Any:
    """The builder's private key (SHIPYARD_BUILDER_KEY, a PEM file), or None: unsigned.
    `shipyard run-stage` has vetted the file before any stage runs
    (pipelines.provenance.builder_key)."""
    import os

    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    path = os.environ.get(KEY_ENV)
    if not path:
        return None
    with open(path, "rb") as fh:
        return load_pem_private_key(fh.read(1 << 16), password=None)
