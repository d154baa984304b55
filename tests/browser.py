"""A real browser for the dashboard's tests: Debian's headless chromium through its chromedriver (selenium).

`make test` installs both (apt-get, as root); a machine without them fails these tests rather than skipping.
"""

from __future__ import annotations

import shutil
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def start_browser():
    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: `make test` installs Debian's chromium and chromium-driver"
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1300,1500")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    return driver


def wait_for(driver, script: str, timeout: float = 60.0, what: str = ""):
    """Until the page's `script` (a JS expression) is truthy; its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(f"return {script};")
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"the page never showed {what or script}")
