"""Build provenance through real DVC: every stage run attests its outputs and inputs, signed
by the builder; a swapped output, a changed input, a foreign or missing signature and a
replayed attestation are each refused; `shipyard cache pull` keeps DVC's `verify = true`
and throws away pulled outputs no trusted builder attested, so `dvc repro` rebuilds them."""

from __future__ import annotations

import base64
import configparser
import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipelines import cache, provenance
from pipelines.bundle_provenance import bundle_chain
from pipelines.cli import main
from tests.conftest import bucket
from tests.keys import keypair
from tests.pipelines.test_end_to_end import commit_all, copy_worktree, ran, sh

REL = "tiny-gpt2"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    a, a_pub = keypair(folder, "builder")
    b, b_pub = keypair(folder, "attacker")
    return {"builder": a, "builder.pub": a_pub, "attacker": b, "attacker.pub": b_pub}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path]) -> Iterator[Path]:
    """A clone that built pin and export of the tiny release with the builder's key."""
    root = commit_all(copy_worktree(tmp_path_factory.mktemp("prov") / "repo"))
    sh(["dvc", "repro", f"export@{REL}"], root, {provenance.KEY_ENV: str(keys["builder"])})
    yield root


def trust(*paths: Path) -> dict[str, object]:
    return provenance.trusted_keys({provenance.TRUST_ENV: ":".join(map(str, paths))})


def stage(root: Path, name: str) -> provenance.StagePaths:
    found = provenance.stage_paths(root, name, REL)
    assert found is not None
    return found


def check(root: Path, name: str, *trusted: Path) -> tuple[str | None, list[str]]:
    return provenance.check(root, stage(root, name), trust(*trusted))


def swap_export(repo: Path, keys: dict[str, Path]) -> bytes:
    """What a writer of the remote or the run-cache can make: export's model swapped and an
    attestation of it signed with their own key (consistent with itself)."""
    model = repo / "build" / REL / "export" / "model.onnx"
    swapped = model.read_bytes() + b"\0"
    model.unlink()  # a new file: the old one is a hardlink into DVC's cache
    model.write_bytes(swapped)
    attacker = provenance.builder_key({provenance.KEY_ENV: str(keys["attacker"])})
    provenance.write(repo, stage(repo, "export"), attacker)
    return swapped


def forge_export(repo: Path, keys: dict[str, Path]) -> bytes:
    """The swap saved by DVC as the run-cache entry for the honest stage's inputs (and in
    dvc.lock and the cache, as DVC has them after a restore)."""
    forged = swap_export(repo, keys)
    sh(["dvc", "commit", "-f", f"export@{REL}"], repo)
    return forged


def test_each_stage_run_attests_every_output_and_input_signed_by_the_builder(
    repo: Path, keys: dict[str, Path]
) -> None:
    for name in ("pin", "export"):
        who, problems = check(repo, name, keys["builder.pub"])
        assert problems == [] and who is not None, (name, problems)
    stmt, signatures, _ = provenance.read(repo / stage(repo, "export").envelope)
    names = {s["name"] for s in stmt["subject"]}
    assert f"build/{REL}/export/model.onnx" in names
    assert not [n for n in names if "metrics" in n]  # the release's file is the bundle's
    assert f"build/{REL}/attestations/export.json" not in names  # not itself
    inputs = {i["name"] for i in stmt["predicate"]["inputs"]}
    assert inputs == {f"build/.params/{REL}/export.json", f"build/{REL}/pin/lock.json"}
    assert len(signatures) == 1
    # pin's own record of the git state keeps its name (they once shared one)
    assert "git" in json.loads((repo / "build" / REL / "pin" / "provenance.json").read_text())


def test_a_rebuild_on_the_same_inputs_writes_the_same_attestation(
    repo: Path, keys: dict[str, Path]
) -> None:
    envelope = repo / stage(repo, "pin").envelope
    before = envelope.read_bytes()
    lock = (repo / "dvc.lock").read_bytes()
    done = sh(
        ["dvc", "repro", "--force", f"pin@{REL}"], repo, {provenance.KEY_ENV: str(keys["builder"])}
    )
    assert ran(done.stdout) == ["pin"]
    assert envelope.read_bytes() == before  # RFC 6979: a deterministic signature
    assert (repo / "dvc.lock").read_bytes() == lock


@contextlib.contextmanager
def tampered(repo: Path, rel: str) -> Iterator[None]:
    path = repo / rel
    original = path.read_bytes()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        yield
    finally:
        path.write_bytes(original)


def test_a_swapped_output_or_a_changed_input_is_named(repo: Path, keys: dict[str, Path]) -> None:
    pub = keys["builder.pub"]
    for rel, want in (
        (f"build/{REL}/export/model.onnx", f"output build/{REL}/export/model.onnx differs"),
        (f"build/{REL}/pin/lock.json", f"input build/{REL}/pin/lock.json differs"),
        (f"build/.params/{REL}/export.json", f"input build/.params/{REL}/export.json differs"),
    ):
        with tampered(repo, rel):
            _, problems = check(repo, "export", pub)
            assert f"{want} from what was attested" in problems, (rel, problems)
    planted = repo / "build" / REL / "export" / "extra.py"
    planted.write_text("import os\n")
    try:
        _, problems = check(repo, "export", pub)
        assert f"output build/{REL}/export/extra.py is not in the attestation" in problems
    finally:
        planted.unlink()
    assert check(repo, "export", pub)[1] == []


def test_an_attestation_signed_by_another_key_unsigned_replayed_or_edited_is_refused(
    repo: Path, keys: dict[str, Path], tmp_path: Path
) -> None:
    pub = keys["builder.pub"]
    envelope = repo / stage(repo, "export").envelope
    original = envelope.read_bytes()
    export = stage(repo, "export")
    attacker = provenance.builder_key({provenance.KEY_ENV: str(keys["attacker"])})
    try:
        # trusted: only the attacker's key, whose holder did not build it
        assert "not signed by a trusted builder" in check(repo, "export", keys["attacker.pub"])[1]
        # the attacker re-attests the outputs with their own key
        provenance.write(repo, export, attacker)
        assert "not signed by a trusted builder" in check(repo, "export", pub)[1]
        # no signature at all
        provenance.write(repo, export, None)
        assert any("carries no signature" in p for p in check(repo, "export", pub)[1])
        # the builder's own, valid attestation of pin, replayed as export's
        shutil.copyfile(repo / stage(repo, "pin").envelope, envelope)
        assert any(f"not export@{REL}" in p for p in check(repo, "export", pub)[1])
        # the builder's signature kept, the statement edited to name a swapped model
        data = json.loads(original)
        stmt = json.loads(base64.b64decode(data["payload"]))
        stmt["subject"][0]["digest"]["sha256"] = "0" * 64
        data["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
        envelope.write_text(json.dumps(data))
        assert "not signed by a trusted builder" in check(repo, "export", pub)[1]
        # garbage and absence are problems, never tracebacks
        for text in (b"", b"{", b"[]", b'{"payloadType": 1}', b"\xff" * 10):
            envelope.write_bytes(text)
            assert check(repo, "export", pub)[1], text
        envelope.unlink()
        assert "no provenance" in check(repo, "export", pub)[1][0]
    finally:
        envelope.write_bytes(original)
    assert check(repo, "export", pub)[1] == []


def test_the_provenance_command_lists_each_stage_and_fails_on_any_untrusted(
    repo: Path,
    keys: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SHIPYARD_ROOT", str(repo))
    code = main(["provenance", REL, "--trusted-builder", str(keys["builder.pub"])])
    out = capsys.readouterr().out
    assert code == 5, out
    assert f"ok   pin@{REL}: built by " in out and f"ok   export@{REL}: built by " in out
    assert f"FAIL quantize@{REL}: " in out and "no provenance" in out  # not built here
    monkeypatch.delenv(provenance.TRUST_ENV, raising=False)
    assert main(["provenance", REL]) == 2  # no trusted key: a missing flag, not a pass
    assert "no trusted builder keys" in capsys.readouterr().err


def test_params_restored_from_another_build_fail_provenance_though_each_stage_holds(
    repo: Path,
    keys: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 42 item 1: a poisoned run-cache entry for `code` restores old params (an old
    runtime's digest); every stage after it is consistent with them, so each attestation
    holds. The params must be what this checkout gives: an old digest, or a missing file,
    fails `shipyard provenance`, and `shipyard fingerprint` mends it."""
    monkeypatch.setenv("SHIPYARD_ROOT", str(repo))
    pub = str(keys["builder.pub"])
    params = repo / "build" / ".params" / REL / "serve.json"
    honest = params.read_text(encoding="utf-8")
    assert "FAIL code" not in _provenance(capsys, pub)
    old = json.loads(honest)
    module = sorted(old["code"])[0]
    old["code"][module] = "0" * 64  # the digest an older checkout's module had
    params.unlink()  # a restored file: the old one may be a hardlink into DVC's cache
    params.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    out = _provenance(capsys, pub)
    assert (
        f"FAIL code: build/.params/{REL}/serve.json is not what this checkout's code and spec "
        "give: not rebuilt since a change, or restored from another build" in out
    ), out
    assert "1 stale params file(s) and " in out  # counted in the verdict, not only printed
    assert f"ok   pin@{REL}: built by " in out  # the stages' own chains still hold
    capsys.readouterr()
    assert main(["fingerprint", "--check"]) == 1  # make release's check after dvc repro
    assert f"stale: build/.params/{REL}/serve.json is not what" in capsys.readouterr().err
    params.unlink()
    assert f"build/.params/{REL}/serve.json is missing" in _provenance(capsys, pub)
    assert main(["fingerprint"]) == 0
    assert main(["fingerprint", "--check"]) == 0
    capsys.readouterr()
    assert params.read_text(encoding="utf-8") == honest
    assert "FAIL code" not in _provenance(capsys, pub)
    # another release's params are not this release's business
    other = repo / "build" / ".params" / "gpt2-small" / "serve.json"
    kept = other.read_text(encoding="utf-8")
    try:
        other.unlink()
        other.write_text("{}\n", encoding="utf-8")
        assert "FAIL code" not in _provenance(capsys, pub)
    finally:
        other.unlink()
        other.write_text(kept, encoding="utf-8")


def _provenance(capsys: pytest.CaptureFixture[str], pub: str) -> str:
    """`shipyard provenance REL`'s output (its exit code is 5 here anyway: quantize and the
    later stages are not built in this fixture)."""
    assert main(["provenance", REL, "--trusted-builder", pub]) == 5
    captured = capsys.readouterr()
    return captured.out + captured.err


def local_config(root: Path) -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(root / ".dvc" / "config.local")
    return config


def test_cache_configure_sets_verify_and_keeps_what_the_user_set(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", str(tmp_path / "remote"))
    cache.configure(repo)
    section = "'remote \"shipyard\"'"
    assert local_config(repo)[section]["verify"] == "true"
    sh(["dvc", "remote", "modify", "--local", "shipyard", "jobs", "3"], repo)
    cache.configure(repo)  # every pull configures again
    config = local_config(repo)
    assert config[section]["verify"] == "true" and config[section]["jobs"] == "3"
    assert config[section]["url"] == str(tmp_path / "remote")


def test_a_pulled_output_no_trusted_builder_attested_is_removed_and_rebuilt(
    repo: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(provenance.TRUST_ENV, str(keys["builder.pub"]))
    assert all(line.startswith("trusted ") for line in cache.screen(repo)), cache.screen(repo)
    # what a writer of the remote can do: outputs and a self-made attestation that match
    swap_export(repo, keys)
    lines = cache.screen(repo)
    assert f"rebuild export@{REL}: not signed by a trusted builder" in lines, lines
    assert f"trusted pin@{REL}: built by " in " ".join(lines)
    assert not (repo / "build" / REL / "export").exists()
    done = sh(["dvc", "repro", f"export@{REL}"], repo, {provenance.KEY_ENV: str(keys["builder"])})
    assert ran(done.stdout) == ["export"], done.stdout  # rebuilt, not restored from the cache
    assert check(repo, "export", keys["builder.pub"])[1] == []


def test_without_trusted_builders_cache_pull_says_outputs_are_taken_on_trust(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(provenance.TRUST_ENV, raising=False)
    assert "is not set: pulled outputs are trusted as the remote gave them" in cache.screen(repo)[0]


def bundle_of(repo: Path, dest: Path) -> Path:
    """A bundle-shaped folder from the two built stages: their attestations and a file each."""
    (dest / "attestations").mkdir(parents=True)
    for name in ("pin", "export"):
        shutil.copyfile(repo / stage(repo, name).envelope, dest / "attestations" / f"{name}.json")
    (dest / "model").mkdir()
    shutil.copyfile(
        repo / "build" / REL / "export" / "model_info.json", dest / "model" / "model_info.json"
    )
    shutil.copyfile(repo / "build" / REL / "pin" / "lock.json", dest / "lock.json")
    return dest


def test_a_bundles_chain_holds_only_for_attested_files_and_one_builds_stages(
    repo: Path, keys: dict[str, Path], tmp_path: Path
) -> None:
    trusted = trust(keys["builder.pub"])
    stages = ("pin", "export")
    bundle = bundle_of(repo, tmp_path / "ok")
    lines, problems = bundle_chain(bundle, trusted, stages)
    assert problems == [] and len(lines) == 2, problems
    # what the bundle stage writes itself is named as such (attested outside the bundle)
    (bundle / "monitoring").mkdir()
    (bundle / "monitoring" / "alerts.yml").write_text("groups: []\n")
    assert bundle_chain(bundle, trusted, stages, ("monitoring/",))[1] == []
    assert (
        "monitoring/alerts.yml: no attested stage run produced it"
        in (bundle_chain(bundle, trusted, stages)[1])
    )
    (bundle / "monitoring" / "alerts.yml").unlink()
    # a shipped file no stage produced
    (bundle / "model" / "extra.py").write_text("import os\n")
    assert (
        "model/extra.py: no attested stage run produced it"
        in bundle_chain(bundle, trusted, stages)[1]
    )
    # a trusted builder's attestation of pin from another build (other inputs and outputs)
    mixed = bundle_of(repo, tmp_path / "mixed")
    lock = repo / "build" / REL / "pin" / "lock.json"
    original = lock.read_bytes()
    builder = provenance.builder_key({provenance.KEY_ENV: str(keys["builder"])})
    envelope = repo / stage(repo, "pin").envelope
    kept = envelope.read_bytes()
    try:
        lock.write_bytes(original.replace(b"{", b"{ ", 1))
        provenance.write(repo, stage(repo, "pin"), builder)
        shutil.copyfile(envelope, mixed / "attestations" / "pin.json")
    finally:
        lock.write_bytes(original)
        envelope.write_bytes(kept)
    problems = bundle_chain(mixed, trusted, stages)[1]
    assert f"export: its input build/{REL}/pin/lock.json is not what pin attested" in problems
    assert "lock.json: no attested stage run produced it" in problems
    # an attestation missing, or signed by someone else
    (mixed / "attestations" / "pin.json").unlink()
    assert any(
        p.startswith("pin: ") and "no provenance" in p
        for p in bundle_chain(mixed, trusted, stages)[1]
    )
    assert (
        "export: not signed by a trusted builder"
        in bundle_chain(bundle, trust(keys["attacker.pub"]), stages)[1]
    )


def pushed(
    root: Path, data: bytes, name: str, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A git + DVC repository tracking `model.onnx` (`data`), pushed by `shipyard cache
    push` to bucket `name` on the S3 API at `s3_server`."""
    root.mkdir()
    sh(["git", "init", "-q"], root)
    sh(["dvc", "init", "-q"], root)
    (root / "model.onnx").write_bytes(data)
    sh(["dvc", "add", "-q", "model.onnx"], root)
    monkeypatch.setenv("SHIPYARD_DVC_REMOTE", f"s3://{name}/dvc")
    monkeypatch.setenv("SHIPYARD_DVC_ENDPOINT", s3_server)
    cache.push(root)
    return root


def test_an_object_swapped_on_the_s3_remote_under_its_old_name_is_not_pulled(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DVC names objects by md5 and, unless `verify = true`, trusts a remote's object by its
    name: `cache pull` sets it, so the swapped bytes never reach the workspace."""
    import boto3

    name = bucket()
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=name)
    root = pushed(tmp_path / "repo", b"the real model", name, s3_server, monkeypatch)
    (key,) = [o["Key"] for o in s3.list_objects_v2(Bucket=name)["Contents"]]
    s3.put_object(Bucket=name, Key=key, Body=b"the attacker's model")

    def fresh() -> None:
        shutil.rmtree(root / ".dvc" / "cache")
        shutil.rmtree(root / ".dvc" / "tmp", ignore_errors=True)
        (root / "model.onnx").unlink(missing_ok=True)

    fresh()
    sh(["dvc", "remote", "modify", "--local", "shipyard", "verify", "false"], root)
    sh(["dvc", "pull", "-q", "--remote", "shipyard"], root)  # what DVC does by default
    assert (root / "model.onnx").read_bytes() == b"the attacker's model"
    fresh()
    cache.pull(root)  # configure sets verify = true again
    assert not (root / "model.onnx").exists()  # missing, so `dvc repro` rebuilds it
    cached = [p.read_bytes() for p in (root / ".dvc" / "cache").rglob("*") if p.is_file()]
    assert b"the attacker's model" not in cached


def run_cache_entries(root: Path) -> list[dict]:
    import yaml

    runs = root / ".dvc" / "cache" / "runs"
    return [yaml.safe_load(p.read_text()) for p in runs.rglob("*") if p.is_file()]


def test_an_untrusted_output_dvc_restored_is_evicted_with_its_run_cache_entry_and_rebuilt(
    repo: Path, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """What a forged run-cache entry leaves after `dvc repro --pull`: the attacker's output in
    the workspace, in dvc.lock, in the cache and in a run-cache entry. `shipyard provenance
    --evict` names it and removes all four, so `dvc repro` runs the stage again."""
    forge_export(repo, keys)  # lock, cache and run-cache as DVC has them
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][f"export@{REL}"]
    poisoned = {o["md5"] for o in lock["outs"]}
    monkeypatch.setenv("SHIPYARD_ROOT", str(repo))
    code = main(["provenance", REL, "--evict", "--trusted-builder", str(keys["builder.pub"])])
    out = capsys.readouterr().out
    assert code == 5 and f"FAIL export@{REL}: not signed by a trusted builder" in out, out
    assert f"removed: `dvc repro export@{REL}` rebuilds it" in out
    assert f"ok   pin@{REL}" in out and (repo / "build" / REL / "pin").is_dir()  # trusted: kept
    assert not (repo / "build" / REL / "export").exists()
    assert not [e for e in run_cache_entries(repo) if {o["md5"] for o in e["outs"]} & poisoned]
    done = sh(["dvc", "repro", f"export@{REL}"], repo, {provenance.KEY_ENV: str(keys["builder"])})
    assert ran(done.stdout) == ["export"], done.stdout  # rebuilt, not restored
    assert check(repo, "export", keys["builder.pub"])[1] == []


def test_the_attested_outputs_are_every_out_dvc_yaml_declares_uncached_ones_too() -> None:
    from tests.conftest import REPO

    found = provenance.stage_paths(REPO, "quantize", REL)
    assert found is not None
    assert found.outs == (
        f"build/{REL}/quantize",
        f"build/{REL}/attestations/quantize.json",
        f"build/{REL}/plots/quantize/layer_snr.json",  # a plot, {cache: false}, in dvc.yaml
    )
    assert found.envelope == f"build/{REL}/attestations/quantize.json"


def test_the_shared_cache_reaches_the_endpoint_it_is_given_and_no_other(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHIPYARD_DVC_ENDPOINT alone names the S3 API: with no AWS_ENDPOINT_URL in the
    environment (the fixture sets one for the whole process), a push still lands there."""
    import boto3

    name = bucket()
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    root = pushed(tmp_path / "repo", b"weights", name, s3_server, monkeypatch)
    assert local_config(root)["'remote \"shipyard\"'"]["endpointurl"] == s3_server
    listed = boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=name)
    assert [o["Size"] for o in listed["Contents"]] == [len(b"weights")]


def test_shipyard_build_refuses_a_forged_run_cache_entry_before_any_stage_reads_it(
    repo: Path, keys: dict[str, Path]
) -> None:
    """The shared cache attack with a stale lock: someone who can write the run-cache saves
    their own output of export under the honest stage's key (the newest entry, so DVC
    restores it), and a builder's clone has no dvc.lock for it. With trusted builders set,
    `shipyard build` restores pin (attested: kept), restores export from the forged entry,
    refuses it before the next stage runs and builds export here instead."""
    model = repo / "build" / REL / "export" / "model.onnx"

    def forge() -> bytes:
        forged = forge_export(repo, keys)
        (repo / "dvc.lock").unlink()  # the clone's lock predates the build
        shutil.rmtree(repo / "build" / REL / "export")
        return forged

    forged = forge()
    trusted = trusting(keys)
    done = sh(["shipyard", "build", REL, "--until", "export"], repo, trusted)
    assert f"{REL}: rebuild export@{REL}: not signed by a trusted builder" in done.stdout
    log = (repo / "build" / ".logs" / f"{REL}.log").read_text()
    assert f"trusted pin@{REL}: restored, built by" in log  # pin came from the run-cache too
    restored = log.index(f"Stage 'export@{REL}' is cached")  # DVC took the forged entry
    assert (
        restored < log.index(f"rebuild export@{REL}") < log.index(f"Running stage 'export@{REL}'")
    )
    assert model.read_bytes() != forged
    assert check(repo, "export", keys["builder.pub"])[1] == []
    # without trusted builders, DVC's restore is taken as the cache gave it: what `build` checks
    forged = forge()
    sh(["shipyard", "build", REL, "--until", "export"], repo)
    assert model.read_bytes() == forged
    sh(["dvc", "repro", "--force", "--single-item", f"export@{REL}"], repo, trusted)  # honest again


def trusting(keys: dict[str, Path]) -> dict[str, str]:
    """A builder's environment: its own key, and the builders it trusts (itself)."""
    return {
        provenance.KEY_ENV: str(keys["builder"]),
        provenance.TRUST_ENV: str(keys["builder.pub"]),
    }


def test_a_forged_run_cache_entry_on_the_shared_s3_remote_is_rebuilt_by_a_fresh_clone(
    repo: Path, keys: dict[str, Path], tmp_path: Path, s3_server: str
) -> None:
    """The issue's attack end to end: the forged entry reaches a real S3 API (moto's server)
    through `shipyard cache push`, the honest entry for the same inputs deleted; a builder's
    fresh clone whose dvc.lock predates the build pulls (`cache pull`, then `build --pull`)
    and builds export itself rather than use what the remote gave."""
    import boto3

    name = bucket()
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    remote = {"SHIPYARD_DVC_REMOTE": f"s3://{name}/dvc", "SHIPYARD_DVC_ENDPOINT": s3_server}

    def export_dir() -> str:  # the md5 of export's output folder, as dvc.lock has it
        outs = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][f"export@{REL}"]["outs"]
        return next(o["md5"] for o in outs if o["path"] == f"build/{REL}/export")

    honest = export_dir()
    forged = forge_export(repo, keys)
    assert export_dir() != honest
    for path in (repo / ".dvc" / "cache" / "runs").rglob("*"):
        if path.is_file() and honest in {
            o["md5"] for o in yaml.safe_load(path.read_text())["outs"]
        }:
            path.unlink()  # only the forged entry is left for these inputs
    sh(["shipyard", "cache", "push"], repo, remote)
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    (clone / "dvc.lock").unlink(missing_ok=True)
    env = {**remote, **trusting(keys)}
    sh(["shipyard", "cache", "pull"], clone, env)
    done = sh(["shipyard", "build", REL, "--until", "export", "--pull"], clone, env)
    assert f"{REL}: rebuild export@{REL}: not signed by a trusted builder" in done.stdout
    built = (clone / "build" / REL / "export" / "model.onnx").read_bytes()
    assert built != forged and check(clone, "export", keys["builder.pub"])[1] == []
    log = (clone / "build" / ".logs" / f"{REL}.log").read_text()
    assert f"trusted pin@{REL}: restored, built by" in log  # the honest entries still serve
    assert log.index(f"Stage 'export@{REL}' is cached") < log.index(f"rebuild export@{REL}")


def test_an_evicted_output_pulled_again_by_build_pull_is_rebuilt_not_trusted(
    repo: Path, keys: dict[str, Path], tmp_path: Path, s3_server: str
) -> None:
    """Issue 42 item 3: the forged export is in dvc.lock and on the remote (a poisoned
    push). A clone that keeps the lock: `cache pull` evicts the forged output (no trusted
    signature); `build --pull` then has DVC pull it again for the lock's md5 ("didn't
    change" once pulled, no "is cached" line), and the worker still checks it, evicts it and
    builds export here."""
    import boto3

    name = bucket()
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    remote = {"SHIPYARD_DVC_REMOTE": f"s3://{name}/dvc", "SHIPYARD_DVC_ENDPOINT": s3_server}
    forged = forge_export(repo, keys)
    try:
        commit_all(repo)  # the lock names the forged export: what the clone checks out
        sh(["shipyard", "cache", "push"], repo, remote)
        clone = tmp_path / "clone"
        sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
        env = {**remote, **trusting(keys)}
        sh(["shipyard", "cache", "pull"], clone, env)
        assert not (clone / "build" / REL / "export" / "model.onnx").exists()  # evicted
        done = sh(["shipyard", "build", REL, "--until", "export", "--pull"], clone, env)
        assert f"{REL}: rebuild export@{REL}: not signed by a trusted builder" in done.stdout
        log = (clone / "build" / ".logs" / f"{REL}.log").read_text()
        assert f"Stage 'export@{REL}' is cached" not in log  # not the run-cache path
        built = (clone / "build" / REL / "export" / "model.onnx").read_bytes()
        assert built != forged and check(clone, "export", keys["builder.pub"])[1] == []
    finally:
        sh(["dvc", "repro", "--force", "--single-item", f"export@{REL}"], repo, trusting(keys))
        commit_all(repo)
