"""The widgets in a real browser: JupyterLab 4 served headless, driven by Chromium.

Opens a copy of ``tests/browser/widgets_demo.ipynb``, runs every cell, checks that plotly
drew its SVG, clicks the live widget's buttons and checks that the block view changes,
then opens the exported kernel-free replay and plays it. Screenshots go to
``test-artifacts/`` (git-ignored) for a human to look at.

Needs Debian's Chromium (``apt-get install chromium``; ``make browser``) and Playwright for
Python; skipped, with the reason, without them.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
HERE = Path(__file__).parent
ARTIFACTS = HERE.parent / "test-artifacts"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
STEP_TIMEOUT_MS = 30_000

sys.path.insert(0, str(HERE / "browser"))


def serve_demo(tmp_path, notebook: str):
    """For a fixture: skip without Chromium, Playwright or JupyterLab; else yield the URL of a
    JupyterLab server on a copy of ``tests/browser/<notebook>`` (JupyterLab autosaves)."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: apt-get install chromium (or `make browser`)")
    pytest.importorskip("playwright.sync_api", reason="playwright for Python is not installed")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    from lab_server import running_jupyterlab
    shutil.copy(HERE / "browser" / notebook, tmp_path / notebook)
    with running_jupyterlab(tmp_path) as url:
        yield url


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a copy of the demo notebook; stopped (process group) after."""
    for url in serve_demo(tmp_path, "widgets_demo.ipynb"):
        yield url, tmp_path


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
                                    timeout=STEP_TIMEOUT_MS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(STEP_TIMEOUT_MS)
            yield pg
        finally:
            browser.close()


def wait_for(predicate, timeout_s: float, what: str):
    """Poll ``predicate`` until it returns something truthy; fail saying ``what`` never happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def live_status(pg) -> str:
    """The live widget's status line ("step N · running ...")."""
    texts = pg.locator(".widget-html-content code").all_inner_texts()
    return next((t for t in texts if t.startswith("step ")), "")


def settled_status(pg, quiet_ms: int) -> str:
    """The status line if it stays the same for ``quiet_ms``, else "" (for ``wait_for``)."""
    first = live_status(pg)
    pg.wait_for_timeout(quiet_ms)
    return first if first and live_status(pg) == first else ""


def live_plot_state(pg) -> dict:
    """What the live block view's plot shows now: title, cell texts, the blocks' shapes."""
    return pg.evaluate("""() => {
        const g = document.querySelector('.jupyter-widgets .js-plotly-plot')
               || document.querySelector('.js-plotly-plot');
        const svg = g.querySelector('.main-svg');
        return {title: (g.querySelector('.gtitle') || {}).textContent || '',
                cells: Array.from(g.querySelectorAll('.textpoint')).map(t => t.textContent),
                shapes: g.querySelectorAll('.shapelayer path').length,
                geometry: Array.from(g.querySelectorAll('.shapelayer path'))
                               .map(p => p.getAttribute('d') + p.style.fill).join('|'),
                svg: svg ? svg.outerHTML.length : 0};
    }""")


def test_widgets_in_jupyterlab(lab, page):
    url, root = lab
    ARTIFACTS.mkdir(exist_ok=True)
    pg = page
    t0 = time.monotonic()
    pg.goto(f"{url}/lab/tree/widgets_demo.ipynb?reset")
    pg.wait_for_selector(".jp-Notebook .jp-Cell", state="attached")
    wait_for(lambda: "Idle" in (pg.locator(".jp-StatusBar-TextItem").all_inner_texts() and
                                " ".join(pg.locator(".jp-StatusBar-TextItem").all_inner_texts())),
             45, "the kernel to start (status bar 'Idle')")
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

    def all_cells_ran():
        prompts = pg.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        return prompts and all(re.search(r"\[\d+\]", p) for p in prompts)
    wait_for(all_cells_ran, 60, "every cell to run")
    errors = pg.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [t for t in errors.all_inner_texts() if "Error" in t]
    assert not tracebacks, tracebacks

    # The live widget: buttons, plotly's SVG, the status line.
    pg.wait_for_selector(".jupyter-widgets.widget-button")
    pg.wait_for_selector(".js-plotly-plot .main-svg")
    wait_for(lambda: live_status(pg).startswith("step 2 "), 20, "the live widget's status line")
    before = live_plot_state(pg)
    assert before["svg"] > 0 and before["shapes"] >= 32, before
    # Every plot rendered: the live view, the timeline, the waste chart.
    wait_for(lambda: pg.locator(".js-plotly-plot .main-svg").count() >= 3, 20, "three plotly figures")
    live_output = pg.locator(".jp-Cell").nth(1).locator(".jp-OutputArea")
    live_output.screenshot(path=str(ARTIFACTS / "live_widget_before.png"))

    # Step: the drawing changes with the engine.
    pg.get_by_role("button", name="Step", exact=True).first.click()
    wait_for(lambda: live_status(pg).startswith("step 3 "), 20, "the status line to say step 3")
    after = wait_for(lambda: (s := live_plot_state(pg))["geometry"] != before["geometry"] and s, 20,
                     "the block view to redraw for step 3")
    assert after["svg"] > 0

    # Fork the oldest running sequence: its blocks become shared (×2 in the cells).
    pg.get_by_role("button", name="Fork", exact=True).first.click()
    wait_for(lambda: "fork" in live_status(pg), 20, "the fork to show in the status line")
    forked = live_plot_state(pg)
    assert any("×2" in c for c in forked["cells"]), forked["cells"]
    pg.get_by_role("button", name="Step", exact=True).first.click()
    wait_for(lambda: live_status(pg).startswith("step 4 "), 20, "step 4")
    live_output.screenshot(path=str(ARTIFACTS / "live_widget_after_fork.png"))

    # Hover a block: its tokens and reference count show.
    box = pg.locator(".jupyter-widgets .js-plotly-plot .textpoint").first.bounding_box()
    pg.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)   # plotly's drag layer is on top
    hover_text = "() => (document.querySelector('.jupyter-widgets .js-plotly-plot .hoverlayer') || {}).textContent"
    label = wait_for(lambda: "block 0" in (pg.evaluate(hover_text) or "") and pg.evaluate(hover_text), 10,
                     "the hover label of block 0")
    assert "refs 2" in label and "tokens [" in label, label      # block 0 is shared by r0 and r0#1
    live_output.screenshot(path=str(ARTIFACTS / "live_widget_hover.png"))

    # Play at the chosen speed, then stop: the engine steps by itself meanwhile.
    live_cell = pg.locator(".jp-Cell").nth(1)
    start = int(live_status(pg).split()[1])
    live_cell.locator(".widget-play button").first.click()
    wait_for(lambda: int(live_status(pg).split()[1]) >= start + 2, 20, "play to step the engine twice")
    live_cell.locator(".widget-play button:visible").last.click()     # stop
    # Ticks sent before the stop may still be queued in a busy kernel: they run, then the
    # status must settle (unchanged for 1.5 s) and stay settled.
    stopped = wait_for(lambda: settled_status(pg, 1500), 30, "the status line to settle after stop")
    pg.wait_for_timeout(1500)
    assert live_status(pg) == stopped, "the engine kept stepping after stop"

    # The Output fallback (what Colab gets) draws a plotly figure and redraws it on Step.
    fallback = pg.locator(".jp-Cell").nth(5)
    fallback.scroll_into_view_if_needed()
    fallback.locator(".js-plotly-plot .main-svg").first.wait_for()
    fb_status = lambda: next((t for t in fallback.locator(".widget-html-content code").all_inner_texts()  # noqa: E731
                              if t.startswith("step ")), "")
    assert fb_status().startswith("step 1 ")
    fallback.get_by_role("button", name="Step", exact=True).click()
    wait_for(lambda: fb_status().startswith("step 2 "), 20, "the fallback widget to step")
    fallback.locator(".js-plotly-plot .main-svg").first.wait_for()
    fallback.locator(".jp-OutputArea").first.screenshot(path=str(ARTIFACTS / "live_widget_output_fallback.png"))

    for i, name in [(2, "timeline"), (3, "waste_chart")]:
        out = pg.locator(".jp-Cell").nth(i).locator(".jp-OutputArea")
        out.scroll_into_view_if_needed()
        out.screenshot(path=str(ARTIFACTS / f"{name}.png"))

    # The exported replay plays without any kernel.
    replay = root / "replay.html"
    assert replay.exists() and replay.stat().st_size > 100_000
    pg.goto(replay.as_uri())
    pg.wait_for_selector(".js-plotly-plot .main-svg")
    first = pg.evaluate("() => document.querySelector('.js-plotly-plot').layout.title.text")
    pg.get_by_text("▶ play").click()
    wait_for(lambda: pg.evaluate("() => document.querySelector('.js-plotly-plot').layout.sliders[0].active") >= 3,
             20, "the replay's slider to advance")
    assert pg.evaluate("() => document.querySelector('.js-plotly-plot').layout.title.text") != first
    pg.screenshot(path=str(ARTIFACTS / "replay_export.png"))
    assert time.monotonic() - t0 < 120


@pytest.fixture
def make_lab(tmp_path):
    """The README's ``make lab`` on a copy of ``notebooks/`` (JupyterLab autosaves: never the
    repository's own files); stopped, kernels and all, after."""
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: apt-get install chromium (or `make browser`)")
    pytest.importorskip("playwright.sync_api", reason="playwright for Python is not installed")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    from lab_server import running_make_lab
    notebooks = tmp_path / "notebooks"
    shutil.copytree(HERE.parent / "notebooks", notebooks)
    with running_make_lab(notebooks, tmp_path / "home") as (url, token):
        yield url, token, notebooks


def test_make_lab_opens_chapter_00_unmodified_without_news(make_lab, page, tmp_path):
    """What a student sees first: chapter 00 open, its kernel started, no pop-up asking about
    Jupyter news, the notebook not marked modified (its file untouched), and no warning in
    make lab's terminal."""
    url, token, notebooks = make_lab
    first = notebooks / "00_setup_and_tour.ipynb"
    stored = first.read_bytes()
    pg = page
    pg.goto(f"{url}/?token={token}")                  # the address make lab prints, less its path
    wait_for(lambda: "/lab/tree/00_setup_and_tour.ipynb" in pg.url, 30, "a redirect to chapter 00")
    pg.wait_for_selector(".jp-Notebook .jp-Cell", state="attached")
    tab = pg.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    wait_for(lambda: "00_setup_and_tour.ipynb" in " ".join(tab.all_inner_texts()), 30, "chapter 00's tab")
    assert pg.locator(".jp-Dialog").count() == 0, pg.locator(".jp-Dialog").all_inner_texts()  # no "Select Kernel"
    wait_for(lambda: "Idle" in " ".join(pg.locator(".jp-StatusBar-TextItem").all_inner_texts()),
             60, "the kernel to start (status bar 'Idle')")
    # JupyterLab writes the kernel's kernelspec and language_info when the kernel replies;
    # give it time to do so, then the notebook must still be unmodified.
    pg.wait_for_timeout(3000)
    metadata = pg.evaluate("() => window.jupyterapp.shell.currentWidget.context.model.toJSON().metadata")
    assert metadata["language_info"]["version"] == ".".join(map(str, sys.version_info[:3])), metadata
    dirty = pg.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.jp-mod-dirty").all_inner_texts()
    assert not dirty, f"opened notebooks show as modified: {dirty} (metadata now {metadata})"
    toasts = pg.locator(".Toastify__toast").all_inner_texts()
    assert not any("news" in t.lower() for t in toasts), toasts
    ARTIFACTS.mkdir(exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "make_lab_first_view.png"))
    assert first.read_bytes() == stored, "opening chapter 00 rewrote its file"
    from lab_server import terminal_warnings
    assert not terminal_warnings((tmp_path / "home" / "make-lab.log").read_text())


# ---- chapter 9's beam view -------------------------------------------------------------------
@pytest.fixture
def beams_lab(tmp_path):
    """A JupyterLab server on a copy of ``tests/browser/beams_demo.ipynb``."""
    yield from serve_demo(tmp_path, "beams_demo.ipynb")


def beam_state(cell) -> dict:
    """What one beam widget shows: its status line and the texts of its plot's cells."""
    return {"status": " ".join(cell.locator(".widget-html-content code").all_inner_texts()),
            "cells": cell.locator(".js-plotly-plot .textpoint").all_text_contents()}


def test_beam_widget_steps_through_forks_deaths_and_swaps(beams_lab, page):
    """Both figure paths: Step and Back redraw the tree, the tables and the pools; a swap shows
    the tables naming host blocks (``h3``) and the device pool emptied, then back."""
    ARTIFACTS.mkdir(exist_ok=True)
    pg = page
    pg.goto(f"{beams_lab}/lab/tree/beams_demo.ipynb?reset")
    pg.wait_for_selector(".jp-Notebook .jp-Cell", state="attached")
    wait_for(lambda: "Idle" in " ".join(pg.locator(".jp-StatusBar-TextItem").all_inner_texts()),
             45, "the kernel to start (status bar 'Idle')")
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    wait_for(lambda: pg.locator(".js-plotly-plot .main-svg").count() >= 2, 60, "both beam widgets' plots")
    for index, name in [(0, "figure_widget"), (1, "output_fallback")]:
        cell = pg.locator(".jp-Cell").nth(index)
        cell.scroll_into_view_if_needed()
        wait_for(lambda: "prefill" in beam_state(cell)["status"], 20, f"{name}: the first snapshot")
        first = beam_state(cell)
        assert not any("×" in c for c in first["cells"]), first      # one beam: nothing shared yet
        step = cell.get_by_role("button", name="Step ▶")
        step.click()
        forked = wait_for(lambda: "fork" in (s := beam_state(cell))["status"] and any("×3" in c for c in s["cells"])
                          and s, 20, f"{name}: the fork, a block shared by three beams")
        assert forked["cells"] != first["cells"]
        for _ in range(3):
            step.click()
            pg.wait_for_timeout(300)
        swapped = wait_for(lambda: "swap out" in (s := beam_state(cell))["status"] and s, 20, f"{name}: swap out")
        assert any(c.startswith("h") for c in swapped["cells"]), swapped["cells"]      # tables name host blocks
        cell.locator(".jp-OutputArea").first.screenshot(path=str(ARTIFACTS / f"beams_{name}_swapped.png"))
        step.click()
        wait_for(lambda: "swap in" in beam_state(cell)["status"], 20, f"{name}: swap in")
        assert not any(c.startswith("h") for c in beam_state(cell)["cells"])
        cell.get_by_role("button", name="◀ Back").click()
        wait_for(lambda: "swap out" in beam_state(cell)["status"], 20, f"{name}: back to the swap out")


# ---- chapter 10's radix view -----------------------------------------------------------------
@pytest.fixture
def radix_lab(tmp_path):
    """A JupyterLab server on a copy of ``tests/browser/radix_demo.ipynb``."""
    yield from serve_demo(tmp_path, "radix_demo.ipynb")


def radix_state(cell) -> dict:
    """What one radix widget shows: its status line, the plot's title, node labels and whether
    the next victim's ring is drawn."""
    return {"status": " ".join(cell.locator(".widget-html-content code").all_inner_texts()),
            "title": " ".join(cell.locator(".js-plotly-plot .gtitle").all_text_contents()),
            "labels": cell.locator(".js-plotly-plot .textpoint").all_text_contents(),
            "ring": cell.locator(".js-plotly-plot .scatterlayer .trace").nth(2).locator("path.point").count()}


def test_radix_widget_grows_the_tree_rings_the_victim_and_counts_evictions(radix_lab, page):
    """Both figure paths: New chat and Run to idle grow the tree; Next turn matches a chat's
    path (its hits go up); on the small pool more chats evict, and the title counts it."""
    ARTIFACTS.mkdir(exist_ok=True)
    pg = page
    pg.goto(f"{radix_lab}/lab/tree/radix_demo.ipynb?reset")
    pg.wait_for_selector(".jp-Notebook .jp-Cell", state="attached")
    wait_for(lambda: "Idle" in " ".join(pg.locator(".jp-StatusBar-TextItem").all_inner_texts()),
             45, "the kernel to start (status bar 'Idle')")
    pg.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    wait_for(lambda: pg.locator(".js-plotly-plot .main-svg").count() >= 2, 60, "both radix widgets' plots")
    errors = pg.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert not [t for t in errors.all_inner_texts() if "Error" in t]
    for index, name in [(0, "figure_widget"), (1, "output_fallback")]:
        cell = pg.locator(".jp-Cell").nth(index)
        cell.scroll_into_view_if_needed()
        first = wait_for(lambda: (s := radix_state(cell))["status"].startswith("step ") and s, 20,
                         f"{name}: the status line")
        if name == "output_fallback":            # its chat has not run yet: nothing cached
            assert first["labels"] == ["root"] and first["ring"] == 0, first
        cell.get_by_role("button", name="New chat").click()
        cell.get_by_role("button", name="Run to idle").click()
        idle = lambda state: "running 0 · waiting 0" in state["status"]           # noqa: E731
        ran = wait_for(lambda: idle(s := radix_state(cell)) and s["status"] != first["status"] and s, 20,
                       f"{name}: the run to redraw")
        assert ran["ring"] == 1 and "next victim" in ran["title"], ran        # all finished: evictable
        cached = lambda state: int(re.search(r"(\d+) cached blocks", state["title"])[1])   # noqa: E731
        blocks = cached(ran)
        cell.get_by_role("button", name="Next turn").click()
        cell.get_by_role("button", name="Run to idle").click()
        turned = wait_for(lambda: cached(s := radix_state(cell)) > blocks and s, 20,
                          f"{name}: the next turn's blocks in the tree")
        assert any(label.split()[1] != "h0" for label in turned["labels"][1:]), turned["labels"]   # hits
        evicted = turned
        for _ in range(8):
            if "evictions 0" not in evicted["title"]:
                break
            before = evicted["status"]
            cell.get_by_role("button", name="New chat").click()
            cell.get_by_role("button", name="Run to idle").click()
            evicted = wait_for(lambda: idle(s := radix_state(cell)) and s["status"] != before and s, 20,
                               f"{name}: another chat to run")
        assert "evictions 0" not in evicted["title"] and "evictions" in evicted["title"], evicted
        cell.locator(".jp-OutputArea").first.screenshot(path=str(ARTIFACTS / f"radix_{name}.png"))
    # Hover a node: its blocks, hits and references.
    cell = pg.locator(".jp-Cell").nth(0)
    cell.scroll_into_view_if_needed()
    box = cell.locator(".js-plotly-plot .scatterlayer .trace").nth(1).locator("path.point").nth(1).bounding_box()
    pg.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = "() => (document.querySelector('.jp-Cell .js-plotly-plot .hoverlayer') || {}).textContent"
    label = wait_for(lambda: "hits" in (pg.evaluate(hover) or "") and pg.evaluate(hover), 10, "a node's hover label")
    assert "refs" in label and "blocks [" in label, label
