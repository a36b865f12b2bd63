"""A model uploaded from the new-job form: the archive goes up with a progress bar, the job then
starts from it (its config, weights and tokenizer), and going back to a config undoes exactly that."""

from __future__ import annotations

import yaml

from tests.browser.conftest import screenshot
from tests.browser.test_new_form import CUT_OFF, example, open_form, selected_text, shown_spec
from tests.engine.test_uploaded_models import save_upload
from tests.service.test_models import files_in, tar_of


def test_an_uploaded_model_becomes_what_the_job_starts_from(browser, key, tmp_path):
    archive = tmp_path / "tiny-llama.tar"
    archive.write_bytes(tar_of(files_in(save_upload(tmp_path / "llama", "llama"))))
    page = open_form(browser, key)
    page.locator("#preset").select_option("llama-pysource-bpe")
    before = example("llama-pysource-bpe")
    assert page.locator("#f-model").input_value() == "" and page.locator("#f-model-file").is_visible()
    page.locator("#f-model-file").set_input_files(archive)
    page.locator("#upload-model").click()
    page.locator("#model-status", has_text="Uploaded tiny-llama.tar: llama").wait_for()
    model_id = page.locator("#f-model").input_value()
    assert model_id.startswith("mdl_")
    assert "(llama, " in selected_text(page, "#f-model") and model_id in selected_text(page, "#f-model")
    assert selected_text(page, "#f-tokenizer") == "the model's own (set in the spec)"
    spec = shown_spec(page)
    assert spec["model"] == {"arch": "hf", "seq_len": 128, "hf": {"model_id": model_id}}
    assert spec["data"] == before["data"] | {"tokenizer": {"type": "model"}}
    assert spec["optimizer"] == before["optimizer"] and spec["train"] == before["train"]
    assert f"model {model_id}" in page.locator("#hf-summary").inner_text()
    assert page.evaluate(CUT_OFF) == []
    screenshot(page, "new-model")
    page.locator("#f-model").select_option("")  # back to a config: the tokenizer goes with the model
    again = shown_spec(page)
    assert again["model"] == {"arch": "hf", "seq_len": 128} and "tokenizer" not in again["data"]
    page.locator("#raw").fill(yaml.safe_dump(spec))  # a pasted spec naming the model selects it
    page.wait_for_function(f"() => document.getElementById('f-model').value === '{model_id}'")
