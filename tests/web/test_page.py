"""The web page (api/static) in headless Chromium, against a fake API server.

The fake implements ``GET /``, ``/static``, ``/v1/jobs``, ``/v1/jobs/{id}`` and the SSE stream
``/v1/jobs/{id}/events`` (docs/api.md). Its one job starts when the first client opens the stream:
~3 s of metrics (with a restart from the step-10 checkpoint half-way), checkpoints and log lines,
then ``SUCCEEDED``. Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package;
skipped when Chromium is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parents[2] / "api" / "static"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
SCREENSHOT = "/tmp/hpservice-page.png"

JOB_ID = "tiny-cpu-3f2a9c1d"
STEPS = 30
TICK_S = 0.085  # one metrics record per tick: 35 records (5 replayed after the restart) ~ 3 s
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
KEEP = 2  # the job's checkpoint.keep
RESTART_REASON = "rank 1 exited with code 137 (OOM killed); restarting from step 10"

LOSS = '[data-testid="loss-chart"]'
STATE = '[data-testid="job-state"]'
ROW = '[data-testid="job-row"]'


class FakeJob:
    """One job; its events are produced on the server's loop once the first stream opens."""

    def __init__(self) -> None:
        now = time.time()
        self.events: list[tuple[int, str, dict]] = []
        self.started = False
        self.stream_queries: list[dict[str, str]] = []
        self.downloads: list[tuple[str, str | None]] = []  # (artifact, Authorization header)
        self.actions: list[tuple[str, str]] = []  # cancel / delete requests from the page
        self.log_pages: list[int | None] = []  # the limit of each /logs request
        self.deleted = False
        # None: metrics flow every tick; n: the producer holds before its (n+1)-th metrics record,
        # so a test can watch the page take each record in turn whatever the machine's load
        self.metrics_gate: int | None = None
        self._metrics_sent = 0
        self._task: asyncio.Task | None = None
        self.job = {
            "id": JOB_ID,
            "name": "tiny-cpu",
            "owner": "alice",
            "state": "QUEUED",
            "message": "waiting for resources",
            "step": 0,
            "total_steps": STEPS,
            "restarts": 0,
            "restart_reasons": [],
            "created_at": now,
            "updated_at": now,
            "history": [{"state": "QUEUED", "time": now, "message": "waiting for resources"}],
            "checkpoints": [],
            "spec": {
                "name": "tiny-cpu", "model": {"lora": {"r": 8, "lora_alpha": 16}}, "training": {"steps": STEPS},
                "memory_estimate": {  # as admission plans it (hpservice.preflight.plan_memory)
                    "device": "cuda", "peak_gib": 1.25, "micro_batch": 2, "device_memory_gib": 80.0,
                    "auto": {"chosen": "dp_shard 2, micro_batch 2, activation_checkpointing none"},
                    "ranks": [{"ranks": "every rank", "peak_gib": 1.25, "phase": "forward and backward", "components_gib": {}}],
                    "assumptions": [],
                },
            },
            "ray_dashboard_url": "http://127.0.0.1:8265/#/actors",
        }

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._task = asyncio.get_running_loop().create_task(self._produce())

    def _emit(self, kind: str, data: dict) -> None:
        job = self.job
        job["updated_at"] = time.time()
        if kind == "state":
            data = {**data, "restarts": job["restarts"], "time": job["updated_at"]}
            job["state"], job["message"] = data["state"], data["message"]
            job["history"].append({"state": data["state"], "time": data["time"], "message": data["message"]})
        elif kind == "metrics":
            job["step"] = data["step"]
        elif kind == "checkpoint":  # checkpoint.keep: 2, as the server reports it: the older ones are pruned
            job["checkpoints"] = [*job["checkpoints"], {**data, "time": job["updated_at"]}][-KEEP:]
            data = {**data, "kept": [c["step"] for c in job["checkpoints"]]}
        self.events.append((len(self.events) + 1, kind, data))

    async def _produce(self) -> None:
        self._emit("state", {"state": "STARTING", "message": "placing 2 workers"})
        await asyncio.sleep(TICK_S)
        self.job["placement"] = [
            {"rank": r, "node_id": f"{n}" * 56, "node_ip": ip, "node": f"node {f'{n}' * 8} ({ip})", "bundle": r, "pid": 100 + r}
            for r, (n, ip) in enumerate([("a", "10.0.0.5"), ("b", "10.0.0.6")])
        ]
        self._emit("state", {"state": "RUNNING", "message": "2 workers, rendezvous 10.0.0.5:41234"})
        step = 1
        restarted = False
        while step <= STEPS:
            await asyncio.sleep(TICK_S)
            while self.metrics_gate is not None and self._metrics_sent >= self.metrics_gate:
                await asyncio.sleep(0.01)
            self._metrics_sent += 1
            self._emit(
                "metrics",
                {
                    "step": step,
                    "loss": 5.5 * 0.93**step + 0.4,
                    "lr": 3e-4 * min(1.0, step / 5),
                    "grad_norm": 0.6,
                    "tokens_per_s": 12000.0 + 150 * step,
                    "step_time_s": 0.03,
                    **({"val_loss": 5.0 * 0.95**step + 0.5} if step % 10 == 0 else {}),  # eval.interval 10
                    # a MoE job's: layer 3 evens out, layer 1 grows more skewed (the worst at the end)
                    "expert_load": {"1": [40 + step, 40, 40, 40 - step], "3": [50 - step, 40, 40, 30 + step]},
                    "expert_imbalance": (40 + step) / 40,
                    "peak_memory_per_rank_gib": {"0": [1.5, 1.25], "1": [1.4, 1.25]},
                },
            )
            if step % 5 == 0:
                self._emit("log", {"rank": 0, "step": step, "line": f"step {step} loss {5.5 * 0.93**step + 0.4:.3f}"})
            if step % 10 == 0:
                self._emit(
                    "checkpoint", {"step": step, "path": f"/data/ckpt/{JOB_ID}/step-{step}", "metrics": {"loss": 1.7}}
                )
            if step == 15 and not restarted:
                restarted = True
                self.job["restarts"] += 1
                self.job["restart_reasons"].append(RESTART_REASON)
                self._emit("state", {"state": "RESTARTING", "message": RESTART_REASON})
                self._emit("state", {"state": "RUNNING", "message": "2 workers, resumed from step 10"})
                step = 11
                continue
            step += 1
        self._emit("state", {"state": "SUCCEEDED", "message": f"finished {STEPS} steps"})

    async def stream(self, after: int):
        i = after
        while True:
            while i < len(self.events):
                seq, kind, data = self.events[i]
                i += 1
                yield f"id: {seq}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
                if kind == "state" and data["state"] in TERMINAL:
                    return
            await asyncio.sleep(0.02)


ARTIFACT = "rank0-steps3-4.trace.json"
BASELINE = {
    "id": "tiny-cpu-0000base", "name": "baseline", "owner": "alice", "state": "SUCCEEDED", "message": "finished",
    "step": STEPS, "total_steps": STEPS, "restarts": 0, "restart_reasons": [], "created_at": 0.0, "updated_at": 0.0,
    "history": [], "checkpoints": [], "spec": {"name": "baseline"},
}  # fmt: skip


def make_app(fake: FakeJob, token: str | None = None) -> FastAPI:
    app = FastAPI()
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def denied(request: Request, query_ok: bool = False) -> JSONResponse | None:
        if token is None:
            return None
        if request.headers.get("authorization") == f"Bearer {token}":
            return None
        if query_ok and request.query_params.get("token") == token:
            return None
        return JSONResponse({"error": {"code": "unauthorized", "message": "missing or invalid bearer token"}}, 401)

    def not_found(job_id: str) -> JSONResponse:
        return JSONResponse({"error": {"code": "not_found", "message": f"job {job_id} not found"}}, 404)

    # the server's own vocabulary and metric registry: the page must not write them again (imported
    # here, not in the handlers: the page asks for both at once, and two threads importing one
    # package can see it half-initialised)
    from hpservice.api.routes.metric_registry import metric_registry
    from hpservice.api.routes.states import job_states

    app.get("/v1/job-states")(job_states)
    app.get("/v1/metric-registry")(metric_registry)

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html")

    @app.get("/v1/jobs")
    def list_jobs(request: Request):
        # an earlier run to compare with shows up once the live job has ended
        baseline = [BASELINE] if fake.job["state"] == "SUCCEEDED" else []
        return denied(request) or {"items": [] if fake.deleted else [fake.job, *baseline], "next_cursor": None}

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: str, request: Request, since_step: int = 0):
        if (refused := denied(request)) is not None:
            return refused
        if job_id != BASELINE["id"]:
            return not_found(job_id)
        records = [{"step": s, "loss": 5.0 * 0.95**s + 0.6} for s in range(since_step + 1, STEPS + 1)][:25]
        return {"records": records, "next_since_step": records[-1]["step"] if records else since_step}

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, request: Request):
        return denied(request) or (fake.job if job_id == JOB_ID else not_found(job_id))

    @app.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: str, request: Request, since: int = 0, limit: int | None = None):
        if (refused := denied(request)) is not None:
            return refused
        fake.log_pages.append(limit)
        lines = [{**d, "seq": seq} for seq, kind, d in fake.events if kind == "log" and seq > since][:limit]
        return {"lines": lines, "next_since": lines[-1]["seq"] if lines else since}

    @app.get("/v1/jobs/{job_id}/artifacts")
    def artifacts(job_id: str, request: Request):
        if (refused := denied(request)) is not None:
            return refused
        done = fake.job["state"] == "SUCCEEDED"  # the trace appears once the profiled steps ran
        url = f"/v1/jobs/{JOB_ID}/artifacts/{ARTIFACT}"
        return {"artifacts": [{"name": ARTIFACT, "size": 2048, "rank": 0, "url": url}] if done else []}

    @app.get("/v1/jobs/{job_id}/artifacts/{name}")
    def artifact(job_id: str, name: str, request: Request):
        if (refused := denied(request)) is not None:
            return refused
        fake.downloads.append((name, request.headers.get("authorization")))
        return JSONResponse({"traceEvents": []})

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str, request: Request):
        fake.actions.append(("cancel", job_id))
        return denied(request) or fake.job

    @app.post("/v1/jobs/{job_id}/checkpoints/{step}/export")
    def export(job_id: str, step: int, request: Request, format: str = "hf"):
        if (refused := denied(request)) is not None:
            return refused
        fake.actions.append(("export", str(step), format))
        path = f"/data/jobs/alice/{job_id}/exports/step-{step:08d}-{format}"
        return {"step": step, "format": format, "path": path, "files": ["config.json", "model-00001-of-00001.safetensors"]}

    @app.post("/v1/jobs/{job_id}/resubmit")
    def resubmit(job_id: str, request: Request):
        if (refused := denied(request)) is not None:
            return refused
        fake.actions.append(("resubmit", job_id))
        return JSONResponse(fake.job, status_code=201)  # the fake "new" job is the same one

    @app.delete("/v1/jobs/{job_id}")
    def delete(job_id: str, request: Request):
        if (refused := denied(request)) is not None:
            return refused
        fake.actions.append(("delete", job_id))
        fake.deleted = True
        return Response(status_code=204)

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, request: Request):
        if (refused := denied(request, query_ok=True)) is not None:
            return refused
        if job_id != JOB_ID:
            return not_found(job_id)
        fake.stream_queries.append(dict(request.query_params))
        fake.start()
        after = int(request.headers.get("last-event-id") or 0)
        return StreamingResponse(
            fake.stream(after), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    return app


@contextlib.contextmanager
def serve(app: FastAPI):
    """Run ``app`` with uvicorn on a free loopback port in a background thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def browser(tmp_path):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"Chromium is not installed ({CHROMIUM}, {CHROMEDRIVER}): apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    options.add_experimental_option("prefs", {"download.default_directory": str(tmp_path / "downloads")})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver, condition, timeout: float = 15.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def click_fresh(driver, selector: str) -> bool:
    """Click the first element ``selector`` finds now; False (ask again) when the page replaced
    it between the find and the click, as a list that re-renders on every poll does."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        css(driver, selector).click()
    except StaleElementReferenceException:
        return False
    return True


def text_fresh(driver, selector: str) -> str | None:
    """The text of the first element ``selector`` finds now; None (ask again) when there is none
    or the page replaced it between the find and the read."""
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        found = css_all(driver, selector)
        return found[0].text if found else None
    except StaleElementReferenceException:
        return None


def css_all(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def watch_points(driver, timeout: float = 20.0) -> list[int]:
    """Sample the loss chart's point count until the job's badge says it ended; the distinct values seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = int(css(driver, LOSS).get_attribute("data-points"))
        if not seen or n != seen[-1]:
            seen.append(n)
        if css(driver, STATE).text in TERMINAL:
            seen.append(int(css(driver, LOSS).get_attribute("data-points")))
            break
        time.sleep(0.05)
    return seen


def test_page_shows_a_live_job(browser, tmp_path):
    from selenium.webdriver.support.ui import Select

    fake = FakeJob()
    with serve(make_app(fake)) as base:
        browser.get(f"{base}/")
        assert browser.title == "hpservice"

        # the list shows the job, polled from /v1/jobs
        rows = wait(browser, lambda d: css_all(d, ROW))
        assert len(rows) == 1
        assert rows[0].get_attribute("data-job-id") == JOB_ID
        for text in (JOB_ID, "tiny-cpu", "alice", "QUEUED", f"0 / {STEPS}"):
            assert text in rows[0].text
        assert css(browser, "#job-detail").is_displayed() is False
        assert not fake.started

        # selecting it shows the chart and opens the stream
        fake.metrics_gate = 0
        rows[0].click()
        wait(browser, lambda d: css(d, LOSS).is_displayed())
        assert browser.execute_script("return location.hash") == f"#job={JOB_ID}"
        assert rows[0].get_attribute("aria-current") == "true"

        # the chart grows with the stream: each record released shows up as one more point
        points = lambda d: int(css(d, LOSS).get_attribute("data-points"))  # noqa: E731
        for n in range(1, 6):
            fake.metrics_gate = n
            wait(browser, lambda d, n=n: points(d) == n)
            assert fake.job["state"] == "RUNNING"
        fake.metrics_gate = None

        seen = watch_points(browser)
        assert seen == sorted(seen), f"the loss chart lost points: {seen}"
        assert seen[-1] == STEPS, f"restart replays replace points, not add them: {seen}"

        wait(browser, lambda d: css(d, STATE).text == "SUCCEEDED")
        assert css(browser, "#job-message").text == f"finished {STEPS} steps"
        wait(browser, lambda d: "SUCCEEDED" in css(d, ROW).text)
        assert css(browser, '[data-testid="lr-chart"]').get_attribute("data-points") == str(STEPS)
        assert css(browser, '[data-testid="tps-chart"]').get_attribute("data-points") == str(STEPS)
        assert css(browser, '[data-testid="val-chart"]').get_attribute("data-points") == str(STEPS // 10)
        assert css(browser, '[data-testid="job-step"]').text == f"{STEPS} / {STEPS}"
        # a MoE job's expert loads: a heatmap of the most imbalanced layer, a column per step
        heat = css(browser, '[data-testid="experts-heatmap"]')
        assert heat.is_displayed() and heat.get_attribute("data-steps") == str(STEPS)
        assert heat.get_attribute("data-layer") == "1" and heat.get_attribute("data-experts") == "4"
        assert css(browser, '[data-testid="experts-readout"]').text == f"layer 1: 4 experts, busiest {(40 + STEPS) / 40:.2f}x the mean at step {STEPS}"
        Select(css(browser, '[data-testid="experts-layer"]')).select_by_value("3")
        wait(browser, lambda d: css(d, '[data-testid="experts-heatmap"]').get_attribute("data-layer") == "3")
        # every metric the job reported, in the registry's order, with its unit; val_loss from its last step
        rows = css_all(browser, '[data-testid="step-metrics"] tbody tr')
        shown = [r.get_attribute("data-metric") for r in rows]
        assert shown == ["loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "peak_memory_per_rank_gib", "expert_load",
                         "expert_imbalance", "val_loss"]  # fmt: skip
        cells = {r.get_attribute("data-metric"): [c.text for c in r.find_elements("tag name", "td")] for r in rows}
        assert cells["tokens_per_s"][2] == "tokens/s" and cells["expert_load"][1] == "2 rows"
        assert cells["grad_norm"][1] == "0.6" and "(step" not in cells["val_loss"][1]  # step 30 has one

        # checkpoints, restarts with reasons, logs, the Ray link
        # only the committed checkpoints still on storage: step 10's was pruned when step 30's came
        wait(browser, lambda d: len(css_all(d, '[data-testid="checkpoints"] tbody tr')) == KEEP)
        listed = css(browser, '[data-testid="checkpoints"]').text
        assert "/step-20" in listed and "/step-30" in listed and "/step-10" not in listed
        # a checkpoint exports as a Hugging Face directory from its row; a LoRA job's also as its adapter
        wait(browser, lambda d: click_fresh(d, '[data-testid="checkpoints"] tbody tr:last-child [data-testid="export"]'))
        # read in the wait: the table re-renders on each poll, and keeps the export's path
        exported = wait(browser, lambda d: text_fresh(d, '[data-testid="exported"]'))
        assert exported == f"/data/jobs/alice/{JOB_ID}/exports/step-00000030-hf"
        wait(browser, lambda d: click_fresh(d, '[data-testid="checkpoints"] tbody tr:last-child [data-testid="export-peft"]'))
        exported = wait(browser, lambda d: text_fresh(d, '[data-testid="exported-peft"]'))
        assert exported == f"/data/jobs/alice/{JOB_ID}/exports/step-00000030-peft"
        assert fake.actions == [("export", "30", "hf"), ("export", "30", "peft")]
        fake.actions.clear()
        wait(browser, lambda d: RESTART_REASON in css(d, '[data-testid="restart-reasons"]').text)
        assert css(browser, '[data-testid="restart-count"]').text == "1 restart."
        # where each rank runs
        assert css(browser, '[data-testid="placement-summary"]').text == "2 ranks on 2 nodes."
        # the estimate the job was planned with, beside each rank's measured peak
        memory = css(browser, '[data-testid="memory-summary"]').text
        assert "Estimated peak 1.250 GiB per rank on cuda, micro-batch 2 of 80.000 GiB per device" in memory
        assert "chosen by auto: dp_shard 2" in memory
        assert css(browser, '[data-testid="memory-ranks"]').text.splitlines() == [
            "rank 0: measured 1.500 GiB, estimated 1.250 GiB", "rank 1: measured 1.400 GiB, estimated 1.250 GiB"]
        placement = css(browser, '[data-testid="placement"]').text
        assert "node aaaaaaaa (10.0.0.5): rank 0" in placement and "node bbbbbbbb (10.0.0.6): rank 1" in placement
        assert "step 30 loss" in css(browser, '[data-testid="logs"]').text
        # the whole log, a page at a time, and as a file
        css(browser, '[data-testid="full-log-box"] summary').click()
        wait(browser, lambda d: css(d, '[data-testid="full-log"]').get_attribute("data-lines") == "7")
        full = css(browser, '[data-testid="full-log"]').text.splitlines()
        assert full[0] == "[r0 s5] step 5 loss 4.226" and full[-1].startswith("[r0 s30] step 30 loss")
        assert fake.log_pages == [1000] and not css(browser, '[data-testid="log-more"]').is_enabled()  # the end
        css(browser, '[data-testid="log-download"]').click()
        saved = tmp_path / "downloads" / f"{JOB_ID}.log"
        wait(browser, lambda d: saved.is_file() and saved.read_text().splitlines() == full)
        assert css(browser, '[data-testid="ray-link"]').get_attribute("href") == "http://127.0.0.1:8265/#/actors"
        assert "ray get-auth-token" in css(browser, '[data-testid="ray-hint"]').text  # what its token dialog wants
        assert fake.stream_queries == [{}], "one stream, no token in the URL without a token"

        # the profiler trace is listed and downloads through fetch (so a token would go in a header)
        # read in the waits: the list re-renders as the job polls
        assert wait(browser, lambda d: text_fresh(d, '[data-testid="artifacts"] a')) == ARTIFACT
        assert "2.0 KiB" in wait(browser, lambda d: text_fresh(d, '[data-testid="artifacts"]'))
        wait(browser, lambda d: click_fresh(d, '[data-testid="artifacts"] a'))  # the list re-renders as the job polls
        wait(browser, lambda d: fake.downloads)
        assert fake.downloads == [(ARTIFACT, None)]

        # an earlier run overlaid on the loss chart (fetched page by page), and removed again
        wait(browser, lambda d: len(css_all(d, '[data-testid="compare-select"] option')) == 2)
        Select(css(browser, '[data-testid="compare-select"]')).select_by_value(BASELINE["id"])
        wait(browser, lambda d: css(d, LOSS).get_attribute("data-overlays") == "1")
        assert "baseline (tiny-cpu-0000base)" in css(browser, '[data-testid="compare-legend"]').text
        label = css(browser, LOSS).get_attribute("aria-label")
        assert "(x: step, y: loss)" in label and "compared with baseline (tiny-cpu-0000base)" in label, label
        browser.save_screenshot(SCREENSHOT.replace(".png", "-compare.png"))
        css(browser, '[data-testid="compare-legend"] button').click()
        wait(browser, lambda d: css(d, LOSS).get_attribute("data-overlays") == "0")

        # the jobs table fits a 1400-px window without sideways scrolling
        browser.set_window_size(1400, 1000)
        wrap_fits = "const w = document.querySelector('.jobs-panel .table-wrap'); return w.scrollWidth <= w.clientWidth;"
        assert browser.execute_script(wrap_fits)
        browser.save_screenshot(SCREENSHOT)

        # an ended job can be resubmitted and deleted from the page (not cancelled); the list then
        # says how to submit
        assert not css(browser, '[data-testid="job-delete"]').get_attribute("hidden")
        assert css(browser, '[data-testid="job-cancel"]').get_attribute("hidden") is not None
        css(browser, '[data-testid="job-resubmit"]').click()
        wait(browser, lambda d: fake.actions == [("resubmit", JOB_ID)])
        css(browser, '[data-testid="job-delete"]').click()
        wait(browser, lambda d: d.switch_to.alert).accept()
        wait(browser, lambda d: fake.actions == [("resubmit", JOB_ID), ("delete", JOB_ID)])
        empty = wait(browser, lambda d: css(d, '[data-testid="jobs-empty"]').is_displayed() and css(d, '[data-testid="jobs-empty"]'))
        assert "hpservice submit examples/tiny-cpu.yaml" in empty.text
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors


def test_page_asks_for_a_token_and_selects_from_the_hash(browser):
    token = "s3cret-token"
    fake = FakeJob()
    with serve(make_app(fake, token=token)) as base:
        browser.get(f"{base}/#job={JOB_ID}")

        # 401: the token form shows; the stream was refused, so the job has not started
        field = wait(
            browser, lambda d: css(d, '[data-testid="token-input"]') if css(d, "#auth").is_displayed() else None
        )
        assert not fake.started
        field.send_keys(token)
        css(browser, '[data-testid="token-save"]').click()

        # with the token: the list loads, the job from the hash is selected and streams to the end
        wait(browser, lambda d: css_all(d, ROW))
        assert not css(browser, "#auth").is_displayed()
        assert css(browser, LOSS).is_displayed()
        seen = watch_points(browser)
        assert seen[-1] == STEPS, seen
        assert css(browser, STATE).text == "SUCCEEDED"
        assert fake.stream_queries == [{"token": token}]
        assert browser.execute_script("return localStorage.getItem('hpservice.token')") == token

        # a desktop and a phone: nothing wider than the window, and no table wider than its panel
        # (a sideways-scrolling jobs table hides columns, and selecting a row scrolled the ids)
        for width in (1400, 390):
            browser.set_window_size(width, 900)
            wait(browser, lambda d, width=width: d.execute_script("return window.innerWidth") <= width)
            browser.save_screenshot(f"/tmp/hpservice-page-{width}.png")
            overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"the page is {overflow}px wider than a {width}px window"
            for table in ("job-table", "checkpoints"):
                wide = browser.execute_script(
                    "const w = document.querySelector(`[data-testid='${arguments[0]}']`).parentElement;"
                    "return [w.scrollWidth - w.clientWidth, w.scrollLeft]", table
                )
                assert wide == [0, 0], f"at {width}px the {table} table is {wide[0]}px wider than its panel"
            rows = css_all(browser, f'{ROW}[data-job-id="{JOB_ID}"] td')
            shown = [td.text for td in rows if td.is_displayed()]
            assert shown[0] == JOB_ID and "SUCCEEDED" in shown and f"{STEPS} / {STEPS}" in shown, shown
        assert css(browser, LOSS).size["width"] <= 390

        # the saved token is used on the next visit without asking
        browser.refresh()
        wait(browser, lambda d: css(d, STATE).text == "SUCCEEDED")
        assert not css(browser, "#auth").is_displayed()
