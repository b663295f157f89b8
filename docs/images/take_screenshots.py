"""Screenshots of `relevancy serve`'s page: each tab after an explanation, at 1400 px and at phone width; and
`photos_demo.jpg`, two sections of the photo demo's page as a browser shows it.

Starts the server on loopback (`relevancy serve --port 0`), drives Debian's headless Chromium through selenium and
chromium-driver, writes `serve_<tab>_<width>.png` beside this file, and stops the server. `--photos FOLDER` instead
crops `photos_demo.jpg` from FOLDER/photos.html, written by `relevancy demo --photos --out FOLDER` (about 3 minutes).
    python docs/images/take_screenshots.py [--photos FOLDER]
"""
from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from relevancy.core.files import write_atomic

HERE = Path(__file__).resolve().parent
WIDTHS = {"desktop": (1400, 1000), "phone": (390, 844)}


def browser(width: int, height: int) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                 f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def full_page(driver: webdriver.Chrome, width: int, path: Path) -> None:
    """The whole page (not just the window), written atomically."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, max(height, 600) + 140)  # the window's frame takes some of its height
    time.sleep(0.3)
    png = driver.get_screenshot_as_png()
    Image.open(io.BytesIO(png)).load()  # a complete PNG before it is written
    write_atomic(path, png)


def photo(driver: webdriver.Chrome, wait: WebDriverWait, width: int, height: int) -> None:
    """The photo model (when the server offers it): a photograph explained for a concept given by two crops of it."""
    from skimage import data

    driver.set_window_size(width, height)
    driver.find_element(By.ID, "tab-image").click()
    options = [o.get_attribute("value") for o in driver.find_elements(By.CSS_SELECTOR, "#image-model option")]
    if "photo" not in options:
        return
    driver.find_element(By.CSS_SELECTOR, "#image-model option[value=photo]").click()
    driver.find_element(By.CSS_SELECTOR, "#image-samples [data-sample='photo-chelsea']").click()
    with tempfile.TemporaryDirectory() as folder:
        cat = data.chelsea()
        files = []
        for k, (top, left) in enumerate(((20, 80), (60, 140))):
            path = Path(folder) / f"cat_{k}.png"
            Image.fromarray(cat[top:top + 240, left:left + 240]).save(path)
            files.append(str(path))
        driver.find_element(By.ID, "concept-files").send_keys("\n".join(files))
        wait.until(lambda d: d.find_element(By.ID, "concept-count").text.startswith("2 example"))
    driver.find_element(By.ID, "image-run").click()
    wait.until(lambda d: "Explained concept" in d.find_element(By.ID, "image-status").text)
    full_page(driver, width, HERE / "serve_photo_desktop.png")


#: the photo demo's sections in the figure: (first heading, the heading it ends before), in page order
PHOTO_SECTIONS = (("coffee: the last block's [CLS] attention", "astronaut: the last block's [CLS] attention"),
                  ("Composite 1: cat (left) and coffee cup (right)", "Composite 2: person (left) and rocket (right)"))


def photos_figure(folder: Path) -> None:
    """`photos_demo.jpg`: the coffee photograph's attention heads and the first composite explained for each half,
    cut from a full-page screenshot of FOLDER/photos.html at 1400 px."""
    driver = browser(*WIDTHS["desktop"])
    try:
        driver.get((folder / "photos.html").resolve().as_uri())
        tops = driver.execute_script("return Object.fromEntries([...document.querySelectorAll('h2, h3')].map("
                                     "h => [h.textContent, h.getBoundingClientRect().top + scrollY]))")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(WIDTHS["desktop"][0], height + 140)
        time.sleep(0.5)
        page = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    finally:
        driver.quit()
    parts = [page.crop((0, int(tops[first]) - 8, page.width, int(tops[end]) - 8)) for first, end in PHOTO_SECTIONS]
    figure = Image.new("RGB", (page.width, sum(part.height for part in parts)), "white")
    for k, part in enumerate(parts):
        figure.paste(part, (0, sum(previous.height for previous in parts[:k])))
    buffer = io.BytesIO()
    figure.save(buffer, "JPEG", quality=80)
    write_atomic(HERE / "photos_demo.jpg", buffer.getvalue())


def main() -> int:
    if sys.argv[1:2] == ["--photos"]:
        photos_figure(Path(sys.argv[2]))
        return 0
    server = subprocess.Popen([sys.executable, "-m", "relevancy.apps.cli", "serve", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        url = line.split()[2]
        for name, (width, height) in WIDTHS.items():
            driver = browser(width, height)
            try:
                wait = WebDriverWait(driver, 60)
                driver.get(url)
                wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
                driver.find_element(By.CSS_SELECTOR, "#image-samples [data-sample='scene-4']").click()
                driver.find_element(By.CSS_SELECTOR, "input[name=image-method][value=cdam]").click()
                driver.find_element(By.CSS_SELECTOR, "input[name=image-method][value=transformer_attribution]").click()
                driver.find_element(By.ID, "image-run").click()
                wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#image-results .card")) == 4)
                full_page(driver, width, HERE / f"serve_image_{name}.png")
                driver.set_window_size(width, height)
                driver.find_element(By.ID, "tab-text").click()
                driver.find_element(By.CSS_SELECTOR, "input[name=text-method][value=cdam]").click()
                driver.find_element(By.ID, "text-run").click()
                wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#text-results .text-result")) == 2)
                full_page(driver, width, HERE / f"serve_text_{name}.png")
                driver.set_window_size(width, height)
                driver.find_element(By.ID, "tab-pairs").click()
                driver.find_element(By.CSS_SELECTOR, "#pairs-samples [data-sample='scene-4']").click()
                captions = driver.find_element(By.ID, "pairs-captions")
                captions.clear()
                captions.send_keys("a green square\na T-shape")
                driver.find_element(By.CSS_SELECTOR, "input[name=pairs-method][value=cdam]").click()
                driver.find_element(By.ID, "pairs-run").click()
                wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#pairs-results .card")) == 4)
                full_page(driver, width, HERE / f"serve_pairs_{name}.png")
                if name == "desktop":
                    photo(driver, wait, width, height)
            finally:
                driver.quit()
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
