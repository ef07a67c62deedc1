"""`searchrl view`'s page in a real browser: headless Chromium (Debian's chromium and chromium-driver, which
.ci/run installs) opens the generated folder from disk and the test reads what it renders: the questions,
a transcript's segments, the filters, the paired comparison, and the training tokens in their mask colours.
Marked ``browser``: deselected by default (a user's machine may have no Chromium); .ci/run runs it.
Screenshots go to ``SEARCHRL_SCREENSHOTS`` (default: the test's tmp directory)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from searchrl.algorithms import algorithm_config
from searchrl.app.resources import Resources
from searchrl.app.viewer.build import view
from searchrl.core.config import SamplesConfig, TrainerConfig
from searchrl.engine.samples import KINDS, read_samples
from searchrl.engine.trainer import Trainer
from tests.helpers import eval_teacher, tiny_overrides

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TRAINED = "rgb(187, 247, 208)"  # viewer.css --trained
UNTRAINED = "rgb(254, 215, 170)"  # --untrained


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1280,900",
        "--allow-file-access-from-files",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    driver.implicitly_wait(5)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, world_dir, tiny_model_dir):
    """A tiny GRPO run (2 steps, samples saved, one episode a step untrained) and a teacher
    evaluation of 30 questions in its directory, plus a second evaluation with some answers changed."""
    from searchrl.app.experiment import load_experiment

    out = tmp_path_factory.mktemp("view_run")
    exp = load_experiment(None, [*tiny_overrides(world_dir, tiny_model_dir, out), "rollout.temperature=1.0"])
    cfg = TrainerConfig(
        steps=2, batch_size=2, micro_batch_size=3, save_every=10**6, samples=SamplesConfig(groups=2)
    )
    tr = Trainer(
        algorithm="grpo",
        config=algorithm_config("grpo", {"group_size": 3}),
        model_path=exp.model.path,
        cfg=cfg,
        out_dir=out,
        resources=Resources(exp),
    )
    collect = tr.algo.collect

    def one_untrained(indices):  # as DAPO's overlong filtering leaves a row: in the batch, without loss
        trajs, metrics = collect(indices)
        trajs[1].trained = False
        return trajs, metrics

    tr.algo.collect = one_untrained
    tr.run()
    eval_teacher(out, f"data.world_dir={world_dir}", "env.topk=2", "eval.limit=30")
    preds = out / "eval-teacher-test.predictions.jsonl"
    other = out.parent / "other.predictions.jsonl"
    rows = [json.loads(x) for x in preds.read_text().splitlines()]
    for i, r in enumerate(rows):  # flip every third answer
        if i % 3 == 0:
            r["em"] = 1.0 - r["em"]
            r["prediction"] = "flipped"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, other


def screenshot(driver, tmp_path, name):
    where = Path(os.environ.get("SEARCHRL_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.png"
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    return path


def test_the_page_renders_questions_segments_filters_and_mask_colours(browser, run_dir, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    out, other = run_dir
    index = view(out, compare=other, out=tmp_path / "view")
    d = browser
    d.get(index.as_uri())
    assert d.execute_script("return document.title").startswith("searchrl view")
    preds = [json.loads(x) for x in (out / "eval-teacher-test.predictions.jsonl").read_text().splitlines()]
    cards = d.find_elements(By.CSS_SELECTOR, "#questions .question")
    assert len(cards) == len(preds) == 30
    assert cards[0].find_element(By.CSS_SELECTOR, ".qtext").text == preds[0]["question"]

    # a transcript opens into its segments, with retrieved documents and the gold ones marked
    searched = next(i for i, p in enumerate(preds) if p["searches"] and p["gold_hits"])
    cards[searched].find_element(By.CSS_SELECTOR, ".head").click()
    body = cards[searched].find_element(By.CSS_SELECTOR, ".body")
    kinds = [s.get_attribute("class") for s in body.find_elements(By.CSS_SELECTOR, ".seg")]
    assert kinds[0] == "seg seg-prompt" and "seg seg-action" in kinds and "seg seg-observation" in kinds
    assert body.find_elements(By.CSS_SELECTOR, "details.doc.gold")
    screenshot(d, tmp_path, "view-evaluation")

    # filters change what is shown
    wrong = sum(not p["em"] for p in preds)
    assert 0 < wrong < 30
    d.find_element(By.ID, "f-wrong").click()
    assert len(d.find_elements(By.CSS_SELECTOR, "#questions .question")) == wrong
    assert d.find_element(By.ID, "shown-count").text == str(wrong)
    d.find_element(By.ID, "f-wrong").click()
    q = preds[5]["question"]
    d.find_element(By.ID, "f-text").send_keys(q)
    shown = d.find_elements(By.CSS_SELECTOR, "#questions .question .qtext")
    assert shown and all(s.text == q for s in shown)
    d.find_element(By.ID, "f-text").clear()
    Select(d.find_element(By.ID, "f-finish")).select_by_value("answer")
    n = sum(p["finish_reason"] == "answer" for p in preds)
    assert len(d.find_elements(By.CSS_SELECTOR, "#questions .question")) == n

    # compare: the stats table and the discordant questions first
    d.find_element(By.ID, "tab-compare").click()
    stats = d.find_element(By.ID, "compare-stats").text
    assert "EM" in stats and "paired p" in stats
    flipped = len(range(0, 30, 3))
    d.find_element(By.ID, "f-discordant").click()
    assert len(d.find_elements(By.CSS_SELECTOR, "#pairs .pair-card")) == flipped
    screenshot(d, tmp_path, "view-compare")

    # training: every token of the saved rows, trained ones green, masked-out actions orange
    d.find_element(By.ID, "tab-training").click()
    Select(d.find_element(By.ID, "t-step")).select_by_value("1")
    saved = read_samples(out)[0]
    rows = d.find_elements(By.CSS_SELECTOR, "#rows .row")
    assert len(rows) == len(saved["rows"]) == 6
    seen = set()
    for row, rec in zip(rows, saved["rows"]):
        toks = row.find_elements(By.CSS_SELECTOR, ".tok")
        assert len(toks) == len(rec["ids"])
        colours = d.execute_script(
            "return Array.from(arguments[0].querySelectorAll('.tok')).map(e => getComputedStyle(e).backgroundColor)",
            row,
        )
        for c, kind, m in zip(colours, rec["kinds"], rec["loss_mask"]):
            if kind == KINDS["action"]:
                assert c == (TRAINED if m else UNTRAINED)
            else:
                assert c not in (TRAINED, UNTRAINED)
        assert len(row.find_elements(By.CSS_SELECTOR, ".step-end")) == len(rec["steps"])
        seen.update(colours)
    assert {TRAINED, UNTRAINED} <= seen and not saved["rows"][1]["trained"]
    screenshot(d, tmp_path, "view-training")
    # another colouring: trained tokens take a colour from their advantage, the others keep theirs
    Select(d.find_element(By.ID, "t-mode")).select_by_value("advantages")
    valued = d.find_elements(By.CSS_SELECTOR, "#rows .tok.valued")
    assert len(valued) == sum(sum(r["loss_mask"]) for r in saved["rows"])
