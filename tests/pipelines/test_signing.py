"""The manifest is exactly OMS, and signatures interoperate with model_signing both ways."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import model_signing
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pipelines.signing import Identity, hashing_config, sign, verify_signed
from schemas import RegistryError
from stages.bundling.oms import build_manifest, load_manifest, verify_bundle
from tests.conftest import Workspace, remanifest, writable_copy
from tests.keys import keypair

SHIPYARD = str(Path(sys.executable).with_name("shipyard"))


@pytest.fixture
def bundle(built_gpt2: Workspace, tmp_path: Path) -> Path:
    return writable_copy(built_gpt2.out("tiny-gpt2", "bundle"), tmp_path / "bundle")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    private, public = keypair(tmp_path, "team")
    other_private, other_public = keypair(tmp_path, "other")
    return {"private": private, "public": public, "other": other_public}


def library_statement(folder: Path) -> dict:
    from google.protobuf import json_format
    from model_signing._signing.signing import Payload

    payload = Payload(hashing_config().hash(folder))
    return json.loads(json_format.MessageToJson(payload.statement.pb))


def test_the_manifest_is_what_model_signing_produces_for_the_bundle(bundle: Path) -> None:
    ours = json.loads((bundle / "manifest.json").read_text())
    theirs = library_statement(bundle)
    assert ours["predicate"]["resources"] == theirs["predicate"]["resources"]
    assert ours["subject"][0]["digest"] == theirs["subject"][0]["digest"]
    assert ours["predicateType"] == theirs["predicateType"] and ours["_type"] == theirs["_type"]
    serial = theirs["predicate"]["serialization"]
    assert ours["predicate"]["serialization"] == {
        **serial,
        "shard_size": int(serial["shard_size"]),
        "ignore_paths": sorted(serial["ignore_paths"]),
    }


def test_resource_order_labels_and_empty_files_follow_model_signing(tmp_path: Path) -> None:
    # `reports/x.json` sorts after `reports/x/y.json` by path components, though not as strings
    folder = tmp_path / "m"
    (folder / "reports" / "x").mkdir(parents=True)
    (folder / "reports" / "x.json").write_text("a")
    (folder / "reports" / "x" / "y.json").write_text("b")
    (folder / "reports" / "x-y.json").write_text("c")
    (folder / "big.bin").write_bytes(bytes(range(256)) * 40)  # 3 shards of 4 KiB
    (folder / "empty.txt").write_bytes(b"")
    from stages.bundling.hashing import hash_shards

    files = {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}
    files.pop("empty.txt")  # OMS lists no empty files; the bundle stage refuses them
    ours = build_manifest("m", hash_shards(files, 4096), 4096)
    config = (
        model_signing.hashing.Config()
        .use_shard_serialization(shard_size=4096)
        .set_ignored_paths(paths=["manifest.json", "model.sig"], ignore_git_paths=False)
    )
    from google.protobuf import json_format
    from model_signing._signing.signing import Payload

    theirs = json.loads(json_format.MessageToJson(Payload(config.hash(folder)).statement.pb))
    dumped = ours.model_dump(mode="json", by_alias=True)
    assert dumped["predicate"]["resources"] == theirs["predicate"]["resources"]
    assert dumped["subject"][0]["digest"] == theirs["subject"][0]["digest"]
    names = [r["name"] for r in dumped["predicate"]["resources"]]
    assert names.index("reports/x/y.json:0:1") < names.index("reports/x.json:0:1")
    assert dumped["predicate"]["resources"][0]["algorithm"] == "sha256-sharded-4096"


def test_a_bundle_signed_by_shipyard_verifies_with_model_signing(bundle, keys) -> None:
    digest = sign(bundle, private_key=keys["private"])
    assert digest == load_manifest(bundle / "manifest.json").digest
    config = (
        model_signing.verifying.Config()
        .use_elliptic_key_verifier(public_key=keys["public"])
        .set_hashing_config(hashing_config())
    )
    config.verify(bundle, bundle / "model.sig")  # raises on any mismatch
    assert verify_bundle(bundle) == []  # the signature is one of the two fixed skips


def test_a_bundle_signed_by_model_signing_verifies_with_shipyard(bundle, keys) -> None:
    config = (
        model_signing.signing.Config()
        .use_elliptic_key_signer(private_key=keys["private"])
        .set_hashing_config(hashing_config())
    )
    config.sign(bundle, bundle / "model.sig")
    assert (
        verify_signed(bundle, Identity(public_key=keys["public"]))
        == load_manifest(bundle / "manifest.json").digest
    )


def test_verify_refuses_a_signature_by_another_key(bundle, keys) -> None:
    sign(bundle, private_key=keys["private"])
    with pytest.raises(RegistryError, match="signature does not verify with public key"):
        verify_signed(bundle, Identity(public_key=keys["other"]))


def test_verify_refuses_a_file_changed_after_signing(bundle, keys) -> None:
    sign(bundle, private_key=keys["private"])
    card = bundle / "MODEL_CARD.md"
    card.write_text(card.read_text() + "\nedited after signing\n")
    with pytest.raises(RegistryError, match="signature does not verify.*MODEL_CARD.md"):
        verify_signed(bundle, Identity(public_key=keys["public"]))


def test_verify_refuses_a_manifest_replaced_after_signing(bundle, keys) -> None:
    sign(bundle, private_key=keys["private"])
    facts = bundle / "shipyard.json"
    data = json.loads(facts.read_text())
    data["evaluation"]["perplexity"] = 1.0  # a better baseline, manifest re-written to match
    facts.write_text(json.dumps(data))
    remanifest(bundle)
    assert verify_bundle(bundle) == []  # consistent with itself: only the signature tells
    with pytest.raises(RegistryError, match="signature does not verify.*shipyard.json"):
        verify_signed(bundle, Identity(public_key=keys["public"]))


def test_an_unsigned_bundle_is_refused_when_a_key_is_given(bundle, keys) -> None:
    with pytest.raises(RegistryError, match="is not signed: no model.sig"):
        verify_signed(bundle, Identity(public_key=keys["public"]))


def test_cli_sign_then_verify_with_the_public_key(bundle, keys) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [SHIPYARD, *args], text=True, capture_output=True, timeout=120, env=os.environ
        )

    done = run("sign", str(bundle), "--private-key", str(keys["private"]))
    assert done.returncode == 0, done.stderr
    done = run("verify", str(bundle), "--public-key", str(keys["public"]))
    assert done.returncode == 0, done.stderr
    assert "signed by public key" in done.stdout
    done = run("verify", str(bundle), "--public-key", str(keys["other"]))
    assert done.returncode == 5 and "signature does not verify" in done.stderr


def _bad_keys(folder: Path) -> dict[str, Path]:
    """Key files that can never sign or verify with model_signing, each a real file."""
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    folder.mkdir()
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    out: dict[str, Path] = {}

    def put(name: str, data: bytes) -> None:
        out[name] = folder / name
        out[name].write_bytes(data)

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    put("rsa.pem", rsa_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain))
    put(
        "rsa.pub",
        rsa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
    )
    ed = ed25519.Ed25519PrivateKey.generate()
    put("ed25519.pem", ed.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain))
    put(
        "ed25519.pub",
        ed.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
    )
    k1 = ec.generate_private_key(ec.SECP256K1())
    put("k1.pem", k1.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain))
    put(
        "k1.pub", k1.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    p256 = ec.generate_private_key(ec.SECP256R1())
    put(
        "encrypted.pem",
        p256.private_bytes(
            pem,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        ),
    )
    put("private-as-public.pub", p256.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain))
    put("empty.pem", b"")
    put("huge.pem", b"-----BEGIN PUBLIC KEY-----\n" + b"A" * (1 << 20))
    put("garbage.pem", bytes(range(256)))
    out["folder"] = folder / "folder"
    out["folder"].mkdir()
    out["missing"] = folder / "missing.pem"
    return out


def test_every_malformed_key_file_is_a_clear_error_never_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """19 of 25 malformed key files printed tracebacks, require-signature accepted key
    types that can never verify, and an RSA key listed first made every promote crash.
    Through the CLI: sign, verify and require-signature, each bad file named."""
    from pipelines.cli import main
    from tests.pipelines.test_registry_units import make_bundle

    folder = make_bundle(tmp_path / "b")
    registry = ["--registry", str(tmp_path / "registry")]
    bad = _bad_keys(tmp_path / "keys")
    for name, key in bad.items():
        public = name.endswith(".pub") or name in ("folder", "missing", "empty.pem", "huge.pem")
        commands = [["registry", "require-signature", "prod", "--public-key", str(key), *registry]]
        if public:
            commands.append(["verify", str(folder), "--public-key", str(key)])
        if not name.endswith(".pub"):
            commands.append(["sign", str(folder), "--private-key", str(key)])
        for argv in commands:
            code = main(argv)
            err = capsys.readouterr().err
            assert code == 5, (name, argv[0], code, err)
            assert err.startswith("error: ") and str(key) in err, (name, argv[0], err)
            assert "Traceback" not in err
    assert not (tmp_path / "registry" / "policy").exists()  # nothing accepted
    assert not (folder / "model.sig").exists()  # nothing signed

    # a policy written before these checks, an RSA key first: the good key still decides
    from pipelines.registry import Registry
    from schemas.registry import SignaturePolicy

    good_private, good_public = keypair(tmp_path, "good")
    reg = Registry(str(tmp_path / "registry"))
    reg.publish(folder, "demo", "1.0.0")
    sign(folder, private_key=good_private)
    signed = make_bundle(tmp_path / "signed", version="1.0.1")
    sign(signed, private_key=good_private)
    reg.publish(signed, "demo", "1.0.1")
    reg._write(
        reg.path("policy", "prod.json"),
        SignaturePolicy(
            require_signature=True,
            public_keys=[bad["rsa.pub"].read_text(), good_public.read_text()],
        ),
    )
    assert reg.promote("demo", "1.0.1", "prod", "signed").to == "demo@1.0.1"


# ---------------------------------------------------- model_signing's command line, both ways
MODEL_SIGNING = str(Path(sys.executable).with_name("model_signing"))


def ms_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MODEL_SIGNING, *args], text=True, capture_output=True, timeout=300)


def test_a_bundle_signed_with_shipyard_files_serialization_verifies_with_the_cli(
    bundle: Path, keys: dict[str, Path]
) -> None:
    from pipelines.cli import main

    argv = ["sign", str(bundle), "--private-key", str(keys["private"])]
    assert main([*argv, "--serialization", "files"]) == 0  # what a user types
    digest = load_manifest(bundle / "manifest.json").digest  # what the registry records
    done = ms_cli("verify", "key", str(bundle), "--signature", str(bundle / "model.sig"),
                  "--public_key", str(keys["public"]))  # fmt: skip
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stderr
    assert verify_signed(bundle, Identity(public_key=keys["public"])) == digest
    card = bundle / "MODEL_CARD.md"
    card.write_text(card.read_text() + "\nedited after signing\n")
    done = ms_cli("verify", "key", str(bundle), "--signature", str(bundle / "model.sig"),
                  "--public_key", str(keys["public"]))  # fmt: skip
    assert done.returncode == 1, done.stdout


@pytest.mark.parametrize("ignore", [[], ["manifest.json"]])
def test_a_bundle_signed_with_the_cli_verifies_with_shipyard_and_tampering_is_refused(
    bundle: Path, keys: dict[str, Path], ignore: list[str]
) -> None:
    extra = [a for p in ignore for a in ("--ignore-paths", str(bundle / p))]
    done = ms_cli("sign", "key", str(bundle), "--signature", str(bundle / "model.sig"),
                  "--private_key", str(keys["private"]), *extra)  # fmt: skip
    assert done.returncode == 0, done.stderr
    from pipelines.cli import main

    assert main(["verify", str(bundle), "--public-key", str(keys["public"])]) == 0
    assert main(["verify", str(bundle), "--public-key", str(keys["other"])]) != 0
    digest = verify_signed(bundle, Identity(public_key=keys["public"]))
    assert digest == load_manifest(bundle / "manifest.json").digest
    with pytest.raises(RegistryError, match="signature does not verify"):
        verify_signed(bundle, Identity(public_key=keys["other"]))
    facts = bundle / "shipyard.json"
    data = json.loads(facts.read_text())
    data["evaluation"]["perplexity"] = 1.0
    facts.write_text(json.dumps(data))
    remanifest(bundle)  # consistent with itself, not with the signature
    with pytest.raises(RegistryError, match="signature does not verify"):
        verify_signed(bundle, Identity(public_key=keys["public"]))


def test_a_cli_signature_that_leaves_files_out_is_refused(
    bundle: Path, keys: dict[str, Path]
) -> None:
    done = ms_cli(
        "sign", "key", str(bundle), "--signature", str(bundle / "model.sig"),
        "--private_key", str(keys["private"]), "--ignore-paths", str(bundle / "reports"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with pytest.raises(RegistryError, match="leaves .*reports.* out of what it signs"):
        verify_signed(bundle, Identity(public_key=keys["public"]))
