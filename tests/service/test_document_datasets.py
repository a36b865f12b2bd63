"""JSONL and parquet datasets through the service: a bad JSONL line refused at upload with its
number, each upload's format kept, a job's data.format and text_column checked at intake, and a
job that trains on prompt/completion rows on a real worker, its samples answering held-out prompts."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from tests.engine.test_documents import CHATML
from tests.engine.test_uploaded_models import save_upload
from tests.service.test_models import files_in, tar_of
from tests.service.test_models import upload as upload_model
from tests.support.api import events, job
from tests.support.net import wait_for
from tests.support.specs import tiny_spec


def succeeded(client, auth, settings, spec: dict, timeout: float = 120) -> tuple[dict, list[tuple[str, dict]]]:
    """Submit ``spec`` and wait for it: the job, which must have succeeded, and its stored events."""
    created = client.post("/v1/jobs", json=spec, headers=auth)
    assert created.status_code == 201, created.text
    ended = ("succeeded", "failed")
    done = wait_for(lambda: (j := job(client, auth, created.json()["id"]))["status"] in ended and j, timeout=timeout)
    assert done["status"] == "succeeded", done["error"]
    return done, events(settings, done["id"])


def log_lines(stored: list[tuple[str, dict]]) -> list[str]:
    return [payload["message"] for kind, payload in stored if kind == "log"]


def tokenized_with_a_mask(lines: list[str]) -> bool:
    """Whether the job's log says it tokenized its corpus, with some tokens not trained on."""
    return any(line.startswith("tokenized in ") and "of them trained on" in line for line in lines)


def upload(client, auth, filename: str, body: bytes):
    return client.post("/v1/datasets", files={"file": (filename, body)}, headers=auth)


def parquet_bytes(**columns) -> bytes:
    out = io.BytesIO()
    pq.write_table(pa.table(columns), out)
    return out.getvalue()


def sums(n: int) -> bytes:
    """Prompt/completion rows of additions: the completion is the sum."""
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(n) for b in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def test_a_bad_jsonl_line_is_refused_with_its_number(client, auth):
    body = b'{"text": "a"}\n{"text": "b"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n'
    r = upload(client, auth, "chat.jsonl", body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "file" and error["message"].startswith("line 4: ")
    assert 'no "assistant" message' in error["message"]
    assert client.get("/v1/datasets", headers=auth).json()["data"] == []  # nothing stored
    empty = upload(client, auth, "none.jsonl", b"\n\n")
    assert empty.status_code == 422 and "holds no row" in empty.json()["error"]["message"]


def test_each_upload_keeps_its_format(client, auth):
    formats = {}
    for filename, body in (
        ("a.txt", b"some text"),
        ("b.jsonl", sums(3)),
        ("c.parquet", parquet_bytes(id=[1, 2], body=["one", "two"])),
    ):
        r = upload(client, auth, filename, body)
        assert r.status_code == 201, r.text
        formats[filename] = r.json()["format"]
        assert client.get(f"/v1/datasets/{r.json()['id']}", headers=auth).json()["format"] == formats[filename]
    assert formats == {"a.txt": "text", "b.jsonl": "jsonl", "c.parquet": "parquet"}
    numbers = upload(client, auth, "n.parquet", parquet_bytes(n=[1, 2]))
    assert numbers.status_code == 422 and "no string column" in numbers.json()["error"]["message"]
    broken = upload(client, auth, "x.parquet", b"PAR1 not really")
    assert broken.status_code == 422 and "not a readable parquet file" in broken.json()["error"]["message"]


def test_a_jobs_format_and_text_column_are_checked_against_its_dataset(client, auth):
    table = upload(client, auth, "t.parquet", parquet_bytes(id=[1, 2], body=["one", "two"])).json()
    rows = upload(client, auth, "r.jsonl", sums(3)).json()
    for data, param, words in (
        ({"dataset_id": table["id"]}, "data.text_column", "has no column 'text'; its columns: id, body"),
        ({"dataset_id": rows["id"], "format": "parquet"}, "data.format", "is jsonl, not parquet"),
        ({"builtin": "pysource-instruct", "format": "jsonl"}, "data", "has its own format"),
    ):
        r = client.post("/v1/jobs", json=tiny_spec() | {"data": data}, headers=auth)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    fine = client.post("/v1/jobs", json=tiny_spec() | {"data": {"dataset_id": table["id"], "text_column": "body"}},
                       headers=auth)  # fmt: skip
    assert fine.status_code == 201, fine.text


def test_a_job_trains_on_prompt_completion_rows(client, auth, settings, worker):
    dataset = upload(client, auth, "sums.jsonl", sums(20)).json()
    spec = tiny_spec(steps=20) | {"data": {"dataset_id": dataset["id"], "tokenizer": "char"}}
    spec["model"]["seq_len"] = 32
    done, stored = succeeded(client, auth, settings, spec)
    assert tokenized_with_a_mask(log_lines(stored)), log_lines(stored)
    samples = [payload for kind, payload in stored if kind == "sample"]
    assert samples and all(s["prompt"].endswith("=") and "+" in s["prompt"] for s in samples)
    assert done["summary"]["val_loss"] > 0


def test_an_uploaded_model_fine_tunes_on_chats_with_its_chat_template(client, auth, settings, worker, tmp_path):
    from transformers import AutoTokenizer

    directory = save_upload(tmp_path / "llama", "llama")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    chats = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]}
        for w in ("def", "class", "import", "return", "yield", "lambda") * 20
    ]
    dataset = upload(client, auth, "chats.jsonl", "".join(json.dumps(c) + "\n" for c in chats).encode()).json()
    model = upload_model(client, auth, tar_of(files_in(directory))).json()
    spec = {
        "model": {"arch": "hf", "seq_len": 32, "hf": {"model_id": model["id"]}},
        "data": {"dataset_id": dataset["id"], "tokenizer": {"type": "model"}},
        "optimizer": {"name": "muonclip"},
        "train": {"steps": 6, "batch_size": 4, "eval_every": 3, "checkpoint_every": 6},
        "telemetry": {"sample_tokens": 8},
    }
    _, stored = succeeded(client, auth, settings, spec, timeout=180)
    assert tokenized_with_a_mask(log_lines(stored)), log_lines(stored)
    prompts = {p["prompt"] for kind, p in stored if kind == "sample"}
    assert len(prompts) == 1 and prompts.pop().replace(" ", "").endswith("|>assistant\n")  # the generation prompt


def test_jobs_on_one_dataset_tokenize_it_once_and_its_delete_removes_the_tokens(client, auth, settings, worker):
    dataset = upload(client, auth, "sums.jsonl", sums(12)).json()
    spec = tiny_spec(steps=2) | {"data": {"dataset_id": dataset["id"], "tokenizer": {"type": "bpe", "vocab_size": 512}}}
    logs = []
    for _ in range(2):
        logs.append(log_lines(succeeded(client, auth, settings, spec)[1]))
    assert "learning a byte-level BPE of 512 tokens from the corpus" in logs[0]
    assert not any("BPE" in line for line in logs[1]) and any(line.startswith("tokenized earlier") for line in logs[1])
    tokens = settings.cache_dir / "derived"  # the worker's bounded cache: on this host, the API's too
    assert list(tokens.glob(f"{dataset['sha256'][:16]}-*"))
    assert client.delete(f"/v1/datasets/{dataset['id']}", headers=auth).status_code == 204
    assert not list(tokens.glob(f"{dataset['sha256'][:16]}-*"))
