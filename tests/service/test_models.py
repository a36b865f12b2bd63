"""Model uploads on real Postgres: tiny transformers models saved with ``save_pretrained`` go up
as tar, tar.gz and zip archives, are listed, shown and deleted; every archive, config or weights
refused answers 422 and leaves nothing on disk; the storage quota is shared with datasets; the
CLI uploads a directory."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from app.db.models import UploadedModel
from app.db.session import transaction
from app.services import model_archive
from app.services import models as service
from contract.hf import FAMILIES, normalized, parameter_count
from tests.service.test_datasets import settings_changed, tenant_of
from tests.support.api import new_key
from tests.support.cli import muonforge


def tiny_llama(directory: Path, tied: bool = False, shard: str | None = None) -> int:
    """A two-layer llama saved with save_pretrained (safetensors) and a word-level tokenizer in
    ``directory``; its parameter count."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    Tokenizer(WordLevel({"[UNK]": 0, "to": 1, "be": 2}, unk_token="[UNK]")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, int]:
    directory = tmp_path_factory.mktemp("llama")
    return directory, tiny_llama(directory)


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def tar_of(
    files: dict[str, bytes], prefix: str = "./", mode: str = "w", special: Sequence[tarfile.TarInfo] = ()
) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in special:
            tar.addfile(info)
    return buffer.getvalue()


def zip_of(files: dict[str, bytes], prefix: str = "") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(prefix + name, data)
    return buffer.getvalue()


def upload(client, headers, body: bytes, filename: str = "model.tar", name: str | None = None):
    data = {"name": name} if name else None
    return client.post("/v1/models", files={"file": (filename, body)}, data=data, headers=headers)


def left_on_disk(settings, tenant: str) -> list[str]:
    directory = settings.artifact_dir / "models" / tenant
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def fresh_tenant(settings) -> tuple[dict[str, str], str]:
    key = new_key(settings)
    return {"Authorization": f"Bearer {key}"}, tenant_of(settings, key)


# -- stored, listed, shown, deleted ---------------------------------------------------------------
def test_a_model_goes_up_as_tar_and_as_zip_and_is_listed_shown_and_deleted(client, settings, llama):
    directory, parameters = llama
    headers, tenant = fresh_tenant(settings)
    files = files_in(directory)
    assert set(files) == {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                          "tokenizer_config.json"}  # fmt: skip
    as_tar, as_zip = tar_of(files), zip_of(files, prefix="tiny-llama/")  # at the root, or in one directory
    first = upload(client, headers, as_tar, name="tiny")
    assert first.status_code == 201, first.text
    second = upload(client, headers, as_zip, filename="tiny-llama.zip")
    assert second.status_code == 201, second.text
    one, two = first.json(), second.json()
    assert (one["name"], two["name"]) == ("tiny", "tiny-llama.zip")
    for body, archive in ((one, as_tar), (two, as_zip)):
        assert body["id"].startswith("mdl_")
        assert body["model_type"] == "llama" and body["parameters"] == parameters
        assert body["bytes"] == sum(len(data) for data in files.values())
        assert body["sha256"] == hashlib.sha256(archive).hexdigest()
        assert body["files"] == sorted(files)
        assert body["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json"]
        assert body["sizes"] == {
            "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 8, "width": 16, "ffn": 32, "positions": 64,
            "vocab": 64, "tied_embeddings": False,
        }  # fmt: skip
        assert body["config"] == json.loads(files["config.json"])
        assert files_in(settings.artifact_dir / "models" / tenant / body["id"]) == files
        with transaction(settings) as session:  # what workers verify their copies against
            objects = session.get(UploadedModel, body["id"]).objects
        assert objects == {name: [len(data), hashlib.sha256(data).hexdigest()] for name, data in files.items()}
    assert left_on_disk(settings, tenant) == sorted([one["id"], two["id"]])

    listed = client.get("/v1/models", headers=headers).json()
    assert [m["id"] for m in listed["data"]] == [two["id"], one["id"]] and listed["has_more"] is False
    assert "config" not in listed["data"][0]
    page = client.get("/v1/models?limit=1", headers=headers).json()
    assert [m["id"] for m in page["data"]] == [two["id"]] and page["next_after"] == two["id"]
    rest = client.get(f"/v1/models?limit=1&after={two['id']}", headers=headers).json()
    assert [m["id"] for m in rest["data"]] == [one["id"]] and rest["has_more"] is False
    assert client.get(f"/v1/models/{one['id']}", headers=headers).json() == one

    other, _ = fresh_tenant(settings)
    for method in ("get", "delete"):
        r = getattr(client, method)(f"/v1/models/{one['id']}", headers=other)
        assert r.status_code == 404 and r.json()["error"] == {
            "code": "not_found", "message": f"no model {one['id']!r}", "param": "model_id",
        }  # fmt: skip
    assert client.get("/v1/models", headers=other).json()["data"] == []

    r = client.delete(f"/v1/models/{one['id']}", headers=headers)
    assert r.status_code == 204 and r.content == b""
    assert left_on_disk(settings, tenant) == [two["id"]]
    assert client.get(f"/v1/models/{one['id']}", headers=headers).status_code == 404
    assert client.delete(f"/v1/models/{one['id']}", headers=headers).status_code == 404
    assert [m["id"] for m in client.get("/v1/models", headers=headers).json()["data"]] == [two["id"]]


def test_sharded_tied_weights_go_up_as_tar_gz(client, settings, tmp_path):
    """Shards named by the index, and a tied lm_head that save_pretrained leaves out of them."""
    parameters = tiny_llama(tmp_path, tied=True, shard="8KB")
    files = files_in(tmp_path)
    shards = [name for name in files if name.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert "lm_head.weight" not in json.loads(files["model.safetensors.index.json"])["weight_map"]
    headers, tenant = fresh_tenant(settings)
    r = upload(client, headers, tar_of(files, prefix="", mode="w:gz"), filename="tied.tar.gz")
    assert r.status_code == 201, r.text
    assert r.json()["parameters"] == parameters and r.json()["sizes"]["tied_embeddings"] is True
    assert files_in(settings.artifact_dir / "models" / tenant / r.json()["id"]) == files


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_as_transformers_saves_it_is_taken(tmp_path, model_type):
    """The checks of config.json and of the weights against the model the config builds, without
    the API: each family of contract.hf, saved by save_pretrained, passes them, and its parameters
    are contract.hf's count."""
    names = FAMILIES[model_type].names
    sizes = {"layers": 2, "heads": 2, "kv_heads": 1, "width": 16, "ffn": 32, "head_dim": 8, "positions": 32}
    fields = {names[word]: value for word, value in sizes.items() if word in names}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **fields))
    model.save_pretrained(tmp_path)
    config = service.check_config(tmp_path / "config.json")
    parameters = service.check_weights(tmp_path, [p.name for p in tmp_path.iterdir()], config)
    assert parameters == sum(p.numel() for p in model.parameters())
    shape_fields = {k: v for k, v in config.items() if k not in service.NOT_SHAPES}
    assert parameters == parameter_count(normalized(shape_fields), 64)


# -- refusals -------------------------------------------------------------------------------------
def special(name: str, kind: bytes, target: str = "") -> list[tarfile.TarInfo]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return [info]


def config_with(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    config = json.loads(files["config.json"]) | changes
    return files | {"config.json": json.dumps(config).encode()}


def zip_with_symlink(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        link = zipfile.ZipInfo("tokenizer.json")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/passwd")
    return buffer.getvalue()


def without(files: dict[str, bytes], *names: str) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k not in names}


# (name, archive from the model's files, what the message says)
REFUSALS = [
    ("traversal", lambda f: tar_of(f | {"../config.json": b"{}"}, prefix=""), "'../config.json' has '..' in its path"),
    ("traversal inside", lambda f: tar_of(f, prefix="a/../"), "has '..' in its path"),
    ("absolute", lambda f: tar_of(f, prefix="/tmp/"), "'/tmp/config.json' has an absolute path"),
    (
        "symlink",
        lambda f: tar_of(
            without(f, "tokenizer.json"), special=special("tokenizer.json", tarfile.SYMTYPE, "/etc/passwd")
        ),
        "'tokenizer.json' is a link",
    ),
    (
        "hardlink",
        lambda f: tar_of(
            without(f, "tokenizer.json"), special=special("./tokenizer.json", tarfile.LNKTYPE, "./config.json")
        ),
        "'./tokenizer.json' is a link",
    ),
    ("zip symlink", lambda f: zip_with_symlink(without(f, "tokenizer.json")), "'tokenizer.json' is a link"),
    (
        "device",
        lambda f: tar_of(f, special=special("./merges.txt", tarfile.CHRTYPE)),
        "is a device or another special file",
    ),
    (
        "fifo",
        lambda f: tar_of(f, special=special("./vocab.json", tarfile.FIFOTYPE)),
        "is a device or another special file",
    ),
    ("pickle", lambda f: tar_of(f | {"pytorch_model.bin": b"\x80\x04N."}), "pickled weight file: safetensors only"),
    ("pickle pt", lambda f: tar_of(without(f, "model.safetensors") | {"model.pt": b"x"}), "safetensors only"),
    (
        "name",
        lambda f: tar_of(f | {"modeling_llama.py": b"import os"}),
        "'./modeling_llama.py' is not a file of a model directory; the files taken are",
    ),
    ("nested", lambda f: tar_of(f | {"sub/config.json": b"{}"}, prefix=""), "'sub/config.json' is in a subdirectory"),
    ("no config", lambda f: tar_of(without(f, "config.json")), "the archive has no config.json"),
    ("no weights", lambda f: tar_of(without(f, "model.safetensors")), "the archive has no weights"),
    ("not json", lambda f: tar_of(f | {"config.json": b"{nope"}), "config.json is not JSON"),
    (
        "bert",
        lambda f: tar_of(config_with(f, model_type="bert")),
        "model_type 'bert' is not a decoder family this service trains: one of gemma, gemma3_text, gpt2, llama, "
        "mistral, qwen2, qwen3",
    ),
    (
        "auto_map",
        lambda f: tar_of(config_with(f, auto_map={"AutoModelForCausalLM": "m.M"})),
        "config.json sets auto_map: no code",
    ),
    (
        "trust_remote_code",
        lambda f: tar_of(config_with(f, trust_remote_code=True)),
        "config.json sets trust_remote_code",
    ),
    (
        "shape",
        lambda f: tar_of(config_with(f, intermediate_size=48)),
        "the weights do not match config.json: model.layers.0.mlp.gate_proj.weight is [32, 16] in the weights, "
        "[48, 16] by the config",
    ),
    ("layers", lambda f: tar_of(config_with(f, num_hidden_layers=3)), "missing: model.layers.2."),
    ("untied head missing", lambda f: tar_of(drop_tensor(f, "lm_head.weight")), "missing: lm_head.weight"),
    (
        "damaged weights",
        lambda f: tar_of(f | {"model.safetensors": b"\xff" * 16}),
        "model.safetensors is not a safetensors file",
    ),
    ("not an archive", lambda f: b"just some text, not an archive at all" * 20, "not a tar, tar.gz or zip archive"),
    ("empty archive", lambda f: tar_of({}), "the archive holds no files"),
    ("truncated", lambda f: tar_of(f, mode="w:gz")[:-100], "the archive is damaged or truncated"),
]


def drop_tensor(files: dict[str, bytes], name: str) -> dict[str, bytes]:
    """The files with a model.safetensors that lacks one tensor (the others' bytes kept, offsets unchanged)."""
    weights = files["model.safetensors"]
    length = int.from_bytes(weights[:8], "little")
    header = json.loads(weights[8 : 8 + length])
    del header[name]
    raw = json.dumps(header).encode()
    return files | {"model.safetensors": len(raw).to_bytes(8, "little") + raw + weights[8 + length :]}


@pytest.mark.parametrize(("archive", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refused_archives_answer_422_and_leave_nothing(client, settings, llama, archive, message):
    headers, tenant = fresh_tenant(settings)
    r = upload(client, headers, archive(files_in(llama[0])))
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("validation_error", "file")
    assert message in error["message"], error["message"]
    assert left_on_disk(settings, tenant) == []
    assert client.get("/v1/models", headers=headers).json()["data"] == []


def test_too_many_members_and_a_zip_bomb_are_refused(client, settings, llama):
    headers, tenant = fresh_tenant(settings)
    files = files_in(llama[0])
    with settings_changed(settings, max_model_members=3):
        r = upload(client, headers, tar_of(files))
        assert r.status_code == 422 and "more than 3 members" in r.json()["error"]["message"], r.text
    limit = 1 << 20
    bomb = zip_of(files | {"merges.txt": bytes(4 * limit)})  # 4 MiB of zeros: a few kB compressed
    assert len(bomb) < limit // 4
    with settings_changed(settings, max_model_bytes=limit):
        r = upload(client, headers, bomb, filename="bomb.zip")
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"] == (
            "the archive's members declare more than 1,048,576 bytes uncompressed (MUONFORGE_MAX_MODEL_BYTES)"
        )
        gz_bomb = tar_of(files | {"merges.txt": bytes(4 * limit)}, mode="w:gz")
        assert len(gz_bomb) < limit // 4
        r = upload(client, headers, gz_bomb, filename="bomb.tar.gz")
        assert r.status_code == 422 and "the archive unpacks to more than" in r.json()["error"]["message"], r.text
        r = upload(client, headers, tar_of(files | {"merges.txt": bytes(limit)}))  # the archive itself
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "payload_too_large" and r.json()["error"]["param"] == "file"
    assert left_on_disk(settings, tenant) == []


def test_a_tar_header_too_large_to_read_is_refused(client, settings, llama):
    """The tar library reads an extended (PAX) header whole: one past 64 KiB is refused unread."""
    headers, tenant = fresh_tenant(settings)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files_in(llama[0]).items():
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), {"comment": "x" * 70_000}
            tar.addfile(info, io.BytesIO(data))
    r = upload(client, headers, buffer.getvalue())
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"].startswith("the archive has an extended header of 70,0")
    assert left_on_disk(settings, tenant) == []


def test_a_member_holding_more_than_it_declares_is_refused(tmp_path, settings):
    """A copy never goes past a member's declared size (a zip bomb that lies in its directory)."""
    with pytest.raises(Exception, match="holds more than the 4 bytes it declares"):
        model_archive._copy(lambda: io.BytesIO(b"0123456789"), tmp_path / "m", 4, "merges.txt")


# -- the storage quota, shared with datasets ------------------------------------------------------
def test_models_and_datasets_share_the_storage_quota(client, settings, llama):
    headers, tenant = fresh_tenant(settings)
    files = files_in(llama[0])
    size = sum(len(data) for data in files.values())
    with settings_changed(settings, tenant_storage_bytes=size + 1000):
        first = upload(client, headers, tar_of(files))
        assert first.status_code == 201, first.text
        r = upload(client, headers, tar_of(files))
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", "file")
        assert f"{size + 1000:,} bytes" in error["message"] and f"({size:,} bytes in use)" in error["message"]
        assert "datasets and models" in error["message"]
        dataset = client.post("/v1/datasets", files={"file": ("c.txt", b"a" * 1001)}, headers=headers)
        assert dataset.status_code == 413 and dataset.json()["error"]["code"] == "storage_quota_exceeded"
        assert client.post("/v1/datasets", files={"file": ("c.txt", b"a" * 1000)}, headers=headers).status_code == 201
        assert client.delete(f"/v1/models/{first.json()['id']}", headers=headers).status_code == 204
        r = upload(client, headers, tar_of(files))
        assert r.status_code == 201, r.text  # exactly the quota, with the dataset's 1,000 bytes
    assert left_on_disk(settings, tenant) == [r.json()["id"]]


# -- what a process that died left behind ---------------------------------------------------------
def test_the_sweep_removes_old_uploads_that_no_row_names(client, settings, llama):
    headers, tenant = fresh_tenant(settings)
    kept = upload(client, headers, tar_of(files_in(llama[0]))).json()["id"]
    directory = settings.artifact_dir / "models" / tenant
    for name in ("mdl_neverrecorded", "mdl_cutoff.part"):
        (directory / name).mkdir()
        (directory / name / "config.json").write_text("{}")
    (directory / "mdl_cutoff.upload").write_bytes(b"half an archive")
    (directory / "mdl_young.part").mkdir()
    old = time.time() - service.ORPHAN_AGE_SECONDS - 60
    for name in (kept, "mdl_neverrecorded", "mdl_cutoff.part", "mdl_cutoff.upload"):
        os.utime(directory / name, (old, old))
    with transaction(settings) as session:
        assert service.sweep_orphans(session, settings) == 3
    assert left_on_disk(settings, tenant) == sorted([kept, "mdl_young.part"])
    assert client.get(f"/v1/models/{kept}", headers=headers).status_code == 200


# -- the CLI --------------------------------------------------------------------------------------
def test_the_cli_uploads_a_directory_lists_shows_and_deletes_it(settings, api_url, llama):
    directory, parameters = llama
    key = new_key(settings)
    uploaded = muonforge("models", "upload", directory, "--name", "tiny", url=api_url, key=key)
    assert uploaded.returncode == 0, uploaded.stderr
    model_id = uploaded.stdout.strip()
    size = sum(len(data) for data in files_in(directory).values())
    assert f"uploaded {directory} as {model_id} (llama, {parameters:,} parameters, {size:,} bytes)" in uploaded.stderr
    header, row = muonforge("models", "list", url=api_url, key=key).stdout.splitlines()
    assert header.split() == ["id", "source", "name", "type", "parameters", "bytes", "age"]
    assert row.split()[:6] == [model_id, "upload", "tiny", "llama", f"{parameters:,}", f"{size:,}"]
    shown = muonforge("models", "show", model_id, url=api_url, key=key)
    assert shown.returncode == 0, shown.stderr
    assert "tokenizer.json, tokenizer_config.json" in shown.stdout and f"{parameters:,}" in shown.stdout
    as_json = json.loads(muonforge("models", "show", model_id, "--json", url=api_url, key=key).stdout)
    assert as_json["config"]["model_type"] == "llama" and as_json["sizes"]["layers"] == 2
    deleted = muonforge("models", "delete", model_id, url=api_url, key=key)
    assert deleted.returncode == 0 and deleted.stdout.strip() == f"{model_id}: deleted", deleted.stderr
    assert muonforge("models", "list", "--json", url=api_url, key=key).stdout.strip() == "[]"

    refused = muonforge("models", "upload", directory / "config.json", url=api_url, key=key)
    assert refused.returncode == 2
    assert refused.stderr.strip() == "error: file: the file is not a tar, tar.gz or zip archive (422 validation_error)"
