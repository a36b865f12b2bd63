"""The new-job form in headless Chromium: its controls show exactly the spec (a field the spec
leaves out shows the server's default, marked so), an edit changes its own field alone, the page
opens on the quickest preset, and no select or label in the form is cut off."""

from __future__ import annotations

from typing import get_args

import pytest
import yaml

from contract.spec import CLIPPED, JobSpec, OptimizerName
from tests.browser.conftest import screenshot
from tests.support.services import ROOT

MUON_FAMILY = tuple(name for name in get_args(OptimizerName) if name != "adamw")
PRESETS = sorted(path.stem for path in (ROOT / "examples").glob("*.yaml"))
# Fields the API rejects outside their architecture or optimizer: switching away removes them.
EXCLUSIVE = {
    "model.arch": [(("moe",), "model.n_experts"), (("moe",), "model.top_k")],
    "optimizer.name": [(CLIPPED, "optimizer.qk_clip_tau"), (MUON_FAMILY, "optimizer.orthogonalize")],
}
CONTROLS = "#form [data-path]"

# Every option of every shown select in the form that its select cannot show whole (measured on
# a copy holding that option alone, sized to fit it), and every label wider than its box.
CUT_OFF = """() => {
  const cut = [];
  for (const select of document.querySelectorAll("#form select")) {
    if (!select.offsetParent) continue;
    for (const option of select.options) {
      const copy = select.cloneNode(false);
      copy.removeAttribute("id");
      copy.append(option.cloneNode(true));
      Object.assign(copy.style, { width: "auto", minWidth: "0", position: "absolute", visibility: "hidden" });
      select.parentNode.append(copy);
      const needed = copy.getBoundingClientRect().width;
      copy.remove();
      if (needed > select.getBoundingClientRect().width + 0.5) cut.push(`${select.id}: ${option.text}`);
    }
  }
  for (const label of document.querySelectorAll("#form label")) {
    if (label.offsetParent && label.scrollWidth > label.clientWidth) cut.push(`label ${label.textContent}`);
  }
  return cut;
}"""


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text(encoding="utf-8"))


def get(spec: dict, path: str):
    for key in path.split("."):
        spec = spec.get(key) if isinstance(spec, dict) else None
    return spec


def put(spec: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return spec


def open_form(browser, key: str, width: int = 1400):
    page = browser.page(key, width=width)
    page.goto(f"{browser.url}/new")
    page.wait_for_function("() => document.getElementById('raw').value !== ''")
    return page


def shown_spec(page) -> dict:
    return yaml.safe_load(page.locator("#raw").input_value())


def selected_text(page, selector: str) -> str | None:
    return page.locator(selector).evaluate("(s) => (s.selectedOptions[0] ? s.selectedOptions[0].text : null)")


def submitted(page, browser) -> dict:
    """Submits the form and returns the body it sent. The request stops here: it is answered with
    a 422, so no job is made."""
    browser.expect(422)
    bodies = []

    def answer(route):
        bodies.append(route.request.post_data_json)
        error = {"code": "invalid_spec", "message": "held back", "param": None}
        route.fulfill(status=422, json={"error": error})

    page.route("**/v1/jobs", answer)
    page.get_by_role("button", name="Submit job").click()
    page.locator("#form-error", has_text="held back").wait_for()
    page.unroute("**/v1/jobs")
    return bodies[0]


def test_opens_on_the_quickest_preset(browser, key):
    page = open_form(browser, key)
    assert page.locator("#preset").input_value() == "synthetic-muon"
    assert shown_spec(page) == example("synthetic-muon")
    assert page.get_by_label("Steps", exact=True).input_value() == "200"


def test_a_preset_without_a_schedule_keeps_it_out_when_the_name_is_edited(browser, key):
    page = open_form(browser, key)
    page.locator("#preset").select_option("moe-muonclip")
    assert page.locator("#f-schedule").input_value() == "wsd"
    page.locator("#preset").select_option("synthetic-muon")
    assert shown_spec(page) == example("synthetic-muon")
    # Absent fields: the select shows the server's default, marked as such, and stands for "absent".
    assert page.locator("#f-schedule").input_value() == ""
    assert selected_text(page, "#f-schedule") == "constant (default)"
    assert page.locator("#f-tokenizer").input_value() == ""
    assert selected_text(page, "#f-tokenizer") == "byte (default)"
    page.get_by_label("Name").fill("renamed")
    expected = example("synthetic-muon") | {"name": "renamed"}
    assert shown_spec(page) == expected
    assert submitted(page, browser) == expected
    # Choosing the default's own word writes it; choosing "(default)" again removes it.
    page.locator("#f-schedule").select_option("constant")
    assert shown_spec(page)["train"]["lr_schedule"] == "constant"
    page.locator("#f-schedule").select_option("")
    assert shown_spec(page) == expected


def test_a_transformers_model_shows_its_config_and_a_bpe_tokenizer_and_keeps_both(browser, key):
    page = open_form(browser, key)
    page.locator("#preset").select_option("llama-pysource-bpe")
    assert shown_spec(page) == example("llama-pysource-bpe")
    for size in ("#f-n_layer", "#f-n_head", "#f-d_model"):  # an hf model's sizes are its config's
        assert not page.locator(size).is_visible()
    assert page.locator("#hf-summary").inner_text().startswith("llama: 2 layers × 128, 4 heads (2 key/value)")
    assert selected_text(page, "#f-tokenizer") == "bpe, 4,096 tokens (set in the spec)"
    page.get_by_label("Steps", exact=True).fill("20")
    expected = put(example("llama-pysource-bpe"), "train.steps", 20)
    assert shown_spec(page) == expected and submitted(page, browser) == expected
    page.locator("#f-arch").select_option("gpt")
    assert page.locator("#f-n_layer").is_visible() and not page.locator("#hf-summary").is_visible()


def test_a_pasted_spec_without_a_schedule_shows_the_default(browser, key):
    page = open_form(browser, key)
    page.locator("#preset").select_option("moe-muonclip")
    spec = example("moe-muonclip") | {"name": "pasted"}
    del spec["train"]["lr_schedule"], spec["data"]["tokenizer"]
    page.locator("#raw").fill(yaml.safe_dump(spec, sort_keys=False))
    page.wait_for_function("() => document.getElementById('f-name').value === 'pasted'")  # the text was read
    assert page.locator("#f-schedule").input_value() == ""
    assert selected_text(page, "#f-schedule") == "constant (default)"
    assert selected_text(page, "#f-tokenizer") == "byte (default)"
    assert page.locator("#f-warmup").input_value() == "20"
    assert submitted(page, browser) == spec
    # A word the spec's schema does not offer is shown as it is, not replaced.
    page.locator("#raw").fill(yaml.safe_dump(put(spec, "train.lr_schedule", "linear") | {"name": "odd"}))
    page.wait_for_function("() => document.getElementById('f-name').value === 'odd'")
    assert page.locator("#f-schedule").input_value() == "linear"
    assert "linear" in selected_text(page, "#f-schedule")
    # Text a number input cannot hold: the input says what the spec has instead of a default.
    page.locator("#raw").fill(yaml.safe_dump(put(spec, "optimizer.lr", "fast") | {"name": "text"}))
    page.wait_for_function("() => document.getElementById('f-name').value === 'text'")
    assert page.locator("#f-lr").input_value() == ""
    assert page.locator("#f-lr").get_attribute("placeholder") == '"fast" in the spec'
    screenshot(page, "new-pasted")


@pytest.mark.parametrize(
    ("data", "source"),
    [
        ({"path": "corpus.txt"}, "path: corpus.txt (muonforge train only)"),
        ({"dataset_id": "ds_elsewhere", "tokenizer": "char"}, "an uploaded dataset"),
        ({"tokenizer": "char"}, "(not set)"),
        ({"builtin": "pysource", "path": "corpus.txt"}, "several: builtin, path"),
    ],
    ids=["path", "dataset", "none", "several"],
)
def test_the_source_shows_the_specs_and_stays_when_another_field_is_edited(browser, key, data, source):
    page = open_form(browser, key)
    spec = example("synthetic-muon") | {"name": "pasted", "data": data}
    page.locator("#raw").fill(yaml.safe_dump(spec))
    page.wait_for_function("() => document.getElementById('f-name').value === 'pasted'")
    assert selected_text(page, "#f-source") == source
    if "dataset_id" in data:
        assert page.locator("#f-dataset").input_value() == "ds_elsewhere"
    page.get_by_label("Steps", exact=True).fill("30")
    assert shown_spec(page) == put(spec, "train.steps", 30)


def test_an_upload_becomes_the_source_and_nothing_else_changes(browser, key, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200, encoding="utf-8")
    page = open_form(browser, key)
    page.locator("#f-source").select_option("dataset")  # none uploaded yet: no source in the spec
    assert "data" not in shown_spec(page) and page.locator("#f-dataset").is_visible()
    page.locator("#f-file").set_input_files(corpus)
    page.get_by_role("button", name="Upload", exact=True).click()
    page.locator("#upload-status", has_text="Uploaded corpus.txt").wait_for()
    dataset_id = page.locator("#f-dataset").input_value()
    assert dataset_id.startswith("ds_") and selected_text(page, "#f-source") == "an uploaded dataset"
    assert shown_spec(page) == example("synthetic-muon") | {"data": {"dataset_id": dataset_id}}
    assert selected_text(page, "#f-tokenizer") == "byte (default)" and page.locator("#f-tokenizer").is_visible()
    assert page.evaluate(CUT_OFF) == []
    screenshot(page, "new-dataset")


@pytest.mark.parametrize("preset", ["synthetic-muon", "moe-muonclip", "pysource-adamw"])
def test_every_control_shows_its_field_and_an_edit_changes_that_field_alone(browser, key, preset):
    page = open_form(browser, key)
    page.locator("#preset").select_option(preset)
    spec = example(preset)
    trained = JobSpec.model_validate(spec).stored()  # what the job would train with
    ids = page.locator(CONTROLS).evaluate_all("(nodes) => nodes.map((n) => n.id)")
    for node_id in ids:
        control = page.locator(f"#{node_id}")
        if not control.is_visible():
            continue
        path = control.get_attribute("data-path")
        value = get(spec, path)
        if value is not None:
            shown = control.input_value()
            assert (float(shown) if isinstance(value, float) else shown) == (
                value if isinstance(value, float) else str(value)
            ), path
        elif control.evaluate("(n) => n.tagName") == "SELECT":
            assert control.input_value() == "", path
            assert selected_text(page, f"#{node_id}") == f"{get(trained, path)} (default)", path
        elif path != "name":
            assert control.input_value() == "", path
            placeholder = control.get_attribute("placeholder")
            assert placeholder.endswith(" (default)") and float(placeholder.split()[0]) == get(trained, path), path
    for node_id in ids:
        control = page.locator(f"#{node_id}")
        if not control.is_visible():
            continue
        path = control.get_attribute("data-path")
        before = shown_spec(page)
        if control.evaluate("(n) => n.tagName") == "SELECT":
            options = control.evaluate("(s) => [...s.options].map((o) => o.value)")
            new = next(o for o in options if o not in ("", control.input_value()))
            control.select_option(new)
            written = new
        else:
            new = "9" if control.input_value() != "9" else "7"
            control.fill(new)
            written = new if path == "name" else (int(new) if control.get_attribute("data-type") == "int" else 9.0)
        expected = put(before, path, written)
        for allowed, gone in EXCLUSIVE.get(path, []):
            if new not in allowed:
                put(expected, gone, None)
        assert shown_spec(page) == expected, path
    before = shown_spec(page)
    source = "builtin:synthetic" if get(before, "data.builtin") == "pysource" else "builtin:pysource"
    page.locator("#f-source").select_option(source)
    assert shown_spec(page) == put(before, "data.builtin", source.split(":")[1])
    assert list(shown_spec(page)) == list(before)  # the sections keep their order


def test_the_clip_threshold_shows_for_both_clipped_optimizers(browser, key):
    page = open_form(browser, key)
    for name, shown in [("normuonclip", True), ("normuon", False), ("muonclip", True), ("adamw", False)]:
        page.locator("#f-optimizer").select_option(name)
        assert page.locator("#f-tau").is_visible() == shown, name
        assert get(shown_spec(page), "optimizer.name") == name
    page.locator("#f-optimizer").select_option("normuonclip")
    page.locator("#f-tau").fill("50")
    assert get(shown_spec(page), "optimizer.qk_clip_tau") == 50
    page.locator("#f-optimizer").select_option("normuon")  # no clip: its threshold goes
    assert get(shown_spec(page), "optimizer.name") == "normuon"
    assert get(shown_spec(page), "optimizer.qk_clip_tau") is None


def test_per_head_orthogonalization_is_a_muon_family_field(browser, key):
    page = open_form(browser, key)
    page.locator("#f-optimizer").select_option("normuon")
    page.locator("#f-orthogonalize").select_option("per_head")
    assert get(shown_spec(page), "optimizer.orthogonalize") == "per_head"
    page.locator("#f-optimizer").select_option("adamw")  # the API refuses it for AdamW: it goes
    assert not page.locator("#f-orthogonalize").is_visible()
    assert get(shown_spec(page), "optimizer.orthogonalize") is None


@pytest.mark.parametrize("width", [1400, 1000])
def test_no_select_or_label_is_cut_off(browser, key, width):
    page = open_form(browser, key, width=width)
    for preset in PRESETS:
        page.locator("#preset").select_option(preset)
        assert page.evaluate(CUT_OFF) == [], preset
        screenshot(page, f"new-{preset}" if width == 1400 else f"new-{preset}-{width}")


def test_a_422_is_shown_at_its_field(browser, key):
    browser.expect(422)
    page = open_form(browser, key)
    page.get_by_label("Learning rate").fill("50")  # the API allows at most 10
    page.get_by_role("button", name="Submit job").click()
    error = page.locator("#f-lr").locator("xpath=..").locator(".field-error")
    error.wait_for()
    assert "less than or equal to 10" in error.inner_text()
    assert page.evaluate(CUT_OFF) == []
    screenshot(page, "new-422")
