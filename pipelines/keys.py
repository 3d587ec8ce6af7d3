"""PEM key files, checked before model_signing, a registry policy or the build provenance
sees them: one function, every failure a clear error naming the file and the fix."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from schemas import RegistryError

MAX_KEY_BYTES = 64 << 10  # a PEM key is under 1 KB; anything this big is not one
CURVES = ("secp256r1", "secp384r1", "secp521r1")  # what model_signing signs with
KEY_FIX = (
    "model_signing uses elliptic-curve keys (P-256, P-384 or P-521): `openssl ecparam -name "
    "prime256v1 -genkey -noout -out key.pem` and `openssl ec -in key.pem -pubout -out key.pub`"
)


def read_key(path: Path, private: bool = False) -> bytes:
    """A PEM key file, checked before model_signing or a registry policy sees it. Every
    failure (missing, a folder, empty, huge, not PEM, encrypted, an RSA or Ed25519 key, an
    unsupported curve) is one error naming the file and the fix, never a traceback; a key
    type that can never verify is refused here, not at every later promote."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import (
        load_pem_private_key,
        load_pem_public_key,
    )

    kind = "private" if private else "public"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise RegistryError(f"{path}: not a file; give the {kind} key's PEM file")
        if info.st_size == 0 or info.st_size > MAX_KEY_BYTES:
            raise RegistryError(
                f"{path}: {info.st_size} bytes, not a PEM {kind} key (one is under 1 KB)"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read the {kind} key ({exc.strerror})") from None
    try:
        key: Any = (
            load_pem_private_key(data, password=None) if private else load_pem_public_key(data)
        )
    except TypeError:  # a password is needed
        raise RegistryError(
            f"{path}: an encrypted private key; model_signing takes an unencrypted one: "
            "decrypt it (`openssl ec -in key.pem -out plain.pem`) into a file only the "
            "signer can read"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        first = " ".join(str(exc).split())[:120]
        hint = " (a private key? give the .pub)" if b"PRIVATE KEY" in data and not private else ""
        raise RegistryError(f"{path}: not a PEM {kind} key{hint} ({first}). {KEY_FIX}") from None
    want = ec.EllipticCurvePrivateKey if private else ec.EllipticCurvePublicKey
    if not isinstance(key, want):
        name = type(key).__name__.lstrip("_").replace("PrivateKey", "").replace("PublicKey", "")
        raise RegistryError(
            f"{path}: a {name or 'non-EC'} key, which can never sign or verify here. {KEY_FIX}"
        )
    if key.curve.name not in CURVES:
        raise RegistryError(f"{path}: an elliptic-curve key on {key.curve.name}. {KEY_FIX}")
    return data
