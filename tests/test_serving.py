"""Serving: the HTTP service's answers (400 / 503 / 200) without Ray (the continuous batcher alone:
tests/runtime/test_batching.py), and `fluxtrt serve` on Ray Serve over loopback (slow): 64
requests from 16 clients, bad requests, a killed replica, Ctrl-C, two replicas."""

import asyncio
import base64
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fluxtrt.errors import FluxtrtError
from fluxtrt.runtime.assembly import open_pipeline
from fluxtrt.runtime.batching import ContinuousBatcher
from fluxtrt.runtime.options import PipelineOptions
from fluxtrt.serving import BadRequest, Service, parse_edit, parse_request
from tests.runtime.test_batching import MAX_UINT8_DIFF, check_batched_equals_single, diff, random_requests


@pytest.mark.parametrize("body,message", [
    (b"{nope", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"size": "256x256"}', '"prompt" must be a non-empty string'),
    (b'{"prompt": "   "}', '"prompt" must be a non-empty string'),
    (json.dumps({"prompt": "x" * 10_001}).encode(), "at most 10000"),
    (b'{"prompt": "a", "steps": "4"}', '"steps" must be an integer'),
    (b'{"prompt": "a", "steps": 0}', '"steps" must be in 1..1000'),
    (b'{"prompt": "a", "n": true}', '"n" must be an integer'),
    (b'{"prompt": "a", "n": 9}', '"n" must be in 1..8'),
    (b'{"prompt": "a", "guidance": "high"}', '"guidance" must be a number'),
    (b'{"prompt": "a", "seed": -1}', '"seed" must be in 0..'),
    (b'{"prompt": "a", "size": "big"}', '"size" must be "WIDTHxHEIGHT"'),
    (b'{"prompt": "a", "response_format": "url"}', '"response_format" must be "b64_json"'),
    (b'{"prompt": "a", "stpes": 2, "sead": 5}', 'unknown field "stpes" (did you mean "steps"?); the fields are prompt,'),
    (b'{"prompt": "a", "Seed": 5}', 'unknown field "Seed" (did you mean "seed"?)'),
    (b'{"prompt": "a", "xyzzy": 1}', 'unknown field "xyzzy"; the fields are'),
])
def test_bad_bodies_are_one_line(body, message):
    with pytest.raises(BadRequest) as e:
        parse_request(body, (1024, 1024), 28)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_request_defaults_are_run_defaults():
    g = parse_request(b'{"prompt": "a cat"}', (768, 1024), 28)
    assert (g.n, g.width, g.height, g.steps, g.guidance, g.seed) == (1, 1024, 768, 28, 3.5, 0)
    g = parse_request(b'{"prompt": "a", "size": "320x256", "n": 2, "seed": 9, "guidance": 5}', (1024, 1024), 4)
    assert (g.width, g.height, g.n, g.seed, g.guidance, g.steps) == (320, 256, 2, 9, 5.0, 4)


def test_openai_fields_that_change_nothing_are_accepted():
    g = parse_request(b'{"prompt": "a cat", "model": "dall-e-3", "user": "u1", "steps": 3}', (256, 256), 4)
    assert (g.prompt, g.steps) == ("a cat", 3)


def _png(array, mode) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, "PNG")
    return buf.getvalue()


def test_edit_forms_parse_and_refuse_in_one_line():
    """POST /v1/images/edits' form: numbers from form text, the size from the image, the workflow's steps and
    guidance left to it; an alpha mask follows OpenAI (transparent = edit, as `run --mask` white), one without
    alpha is taken as is; each bad form is one line naming its field."""
    rng = np.random.default_rng()
    image = _png(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8), "RGB")
    alpha = rng.integers(0, 2, (48, 80)).astype(np.uint8) * 255
    rgba = np.concatenate([rng.integers(0, 256, (48, 80, 3), dtype=np.uint8), alpha[..., None]], -1)
    req, inputs = parse_edit({"image": image, "mask": _png(rgba, "RGBA"), "prompt": "a fox", "n": "2",
                              "seed": " 7", "strength": "0.5", "lora": '[{"name": "a", "scale": 0.5}]'}, (1024, 1024))
    assert (req.width, req.height, req.n, req.seed, req.steps, req.guidance) == (80, 48, 2, 7, None, None)
    assert req.lora == (("a", 0.5),) and inputs.strength == 0.5 and inputs.image.size == (80, 48)
    assert np.array_equal(np.asarray(inputs.mask.convert("L")), np.where(alpha == 0, 255, 0))
    gray = rng.integers(0, 256, (48, 80), dtype=np.uint8)
    _, inputs = parse_edit({"image": image, "mask": _png(gray, "L"), "prompt": "a", "size": "64x32",
                            "steps": "3", "guidance": "2.5"}, (1024, 1024))
    assert np.array_equal(np.asarray(inputs.mask.convert("L")), gray)
    for form, message in [
        ({"prompt": "a"}, '"image" is required'),
        ({"image": "photo.png", "prompt": "a"}, '"image" must be an uploaded file'),
        ({"image": b"GIF89a nope", "prompt": "a"}, "image (11 bytes uploaded) is not a readable image"),
        ({"image": image, "prompt": "a", "strength": "1.5"}, '"strength" must be in (0, 1]'),
        ({"image": image, "prompt": "a", "steps": "four"}, '"steps" must be an integer'),
        ({"image": image, "prompt": "a", "n": "9"}, '"n" must be in 1..8'),
        ({"image": image, "prompt": "a", "strenght": "0.5"}, 'unknown field "strenght" (did you mean "strength"?)'),
        ({"image": image, "prompt": "a", "seed": b"7"}, '"seed" must be a form field'),
        ({"image": image, "prompt": "a", "lora": "[{"}, '"lora" is not valid JSON'),
        ({"image": image}, '"prompt" must be a non-empty string'),
    ]:
        with pytest.raises(BadRequest) as e:
            parse_edit(form, (1024, 1024))
        assert message in str(e.value) and "\n" not in str(e.value), (form.keys(), str(e.value))


def test_service_cancels_the_work_of_clients_that_gave_up():
    """Seven clients give up after 0.3 s on {"steps": 1000, "n": 8} (Ray Serve cancels their handlers): a normal
    request is answered within seconds, and /health's queue goes back to 0."""
    svc = Service(PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32"), max_batch=4, max_queue=64)
    heavy = b'{"prompt": "a cat", "size": "256x256", "steps": 1000, "n": 8}'

    async def scenario():
        async def impatient():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(svc.generate(heavy), 0.3)

        await asyncio.gather(*(impatient() for _ in range(7)))
        t0 = time.perf_counter()
        status, _, _ = await svc.generate(b'{"prompt": "a dog", "size": "256x256", "steps": 2}')
        return status, time.perf_counter() - t0

    try:
        status, seconds = asyncio.run(scenario())
        assert status == 200 and seconds < 30, seconds
        deadline = time.time() + 10
        while svc.health()["queued"] and time.time() < deadline:
            time.sleep(0.05)
        health = svc.health()
        assert health["queued"] == 0 and health["cancelled"] == 7, health
        assert "fluxtrt_cancelled_total" in svc.metrics_text()
    finally:
        svc.close()


def asgi(app, method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    """One request through an ASGI app (no server, no HTTP client library): (status, JSON body)."""
    sent, got = [{"type": "http.request", "body": body, "more_body": False}], {}
    path, _, query = path.partition("?")

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            got["status"] = message["status"]
        elif message["type"] == "http.response.body":
            got["body"] = got.get("body", b"") + message.get("body", b"")

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    return got["status"], json.loads(got["body"])


def test_the_apps_own_answers_are_the_json_error_shape():
    """What FastAPI answers by itself (a GET on the generate path, no such route, an over-long URL) comes in the
    documented {"error": {"message": ...}} shape, as the routes' own errors do."""
    from fluxtrt.serving import MAX_URL_CHARS, ROUTE, http_api

    api = http_api()

    @api.post(ROUTE)
    async def generations():
        return {"data": []}

    assert asgi(api, "POST", ROUTE) == (200, {"data": []})
    status, body = asgi(api, "GET", ROUTE)
    assert status == 405 and body["error"]["message"] == f"GET {ROUTE} is not allowed; use POST with a JSON body"
    status, body = asgi(api, "GET", "/v1/images/generation")
    assert status == 404 and body["error"]["message"].startswith("no route /v1/images/generation; POST")
    status, body = asgi(api, "GET", ROUTE + "?" + "x" * (MAX_URL_CHARS + 1))
    assert status == 414 and "over the 2048 limit" in body["error"]["message"]


@pytest.mark.parametrize("args,message", [
    (dict(engines=None, model=None, backend="auto"), "pass --engines DIR"),
    (dict(engines=None, model="tiny", backend="auto"), "add --backend torch"),
    (dict(engines=None, model="tiny-control", backend="torch"),
     "serve runs text-to-image, img2img, Fill and Kontext; these are FluxControlPipeline"),
    (dict(engines=Path("/nonexistent"), model=None, backend="auto"), "no manifest.json in /nonexistent"),
])
def test_what_cannot_be_served_is_one_line_before_ray_starts(args, message):
    from fluxtrt.serving import check_servable

    with pytest.raises(FluxtrtError, match=message.replace(".", "\\.")):
        check_servable(**args)


def test_service_answers_without_ray():
    """200 with seeds s, s+1 and base64 PNGs equal to single runs; 400 for a size the engines refuse; 503 with
    Retry-After when the queue is full; and it keeps serving."""
    svc = Service(PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32"), max_batch=2, max_queue=2)
    try:
        status, payload, headers = asyncio.run(svc.generate(b'{"prompt": "a cat", "size": "320x256", "n": 2, '
                                                            b'"steps": 2, "seed": 11}'))
        assert status == 200 and [d["seed"] for d in payload["data"]] == [11, 12]
        for d in payload["data"]:
            img = np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))))
            alone = svc.pipe.generate(["a cat"], 256, 320, 2, 3.5, seed=d["seed"]).images[0]
            assert diff(img, alone) <= MAX_UINT8_DIFF
        assert svc.health()["status"] == "ok"
        status, payload, _ = asyncio.run(svc.generate(b'{"prompt": "a cat", "size": "250x256"}'))
        assert status == 400 and payload["error"]["message"] == "width 250 is not a positive multiple of 16; use 240 or 256"

        async def flood():
            return await asyncio.gather(*(svc.generate(b'{"prompt": "a cat", "size": "256x256", "steps": 3, "n": 2}')
                                          for _ in range(3)))

        answers = asyncio.run(flood())
        assert sorted(a[0] for a in answers) == [200, 503, 503]
        assert all(a[2].get("Retry-After") for a in answers if a[0] == 503)
        assert asyncio.run(svc.generate(b'{"prompt": "a dog", "size": "256x256", "steps": 1}'))[0] == 200
        text = svc.metrics_text()
        assert f'fluxtrt_queue_depth{{replica="{os.getpid()}"}} 0' in text
        steps = int(next(ln for ln in text.splitlines() if ln.startswith("fluxtrt_steps_total")).split()[-1])
        assert steps >= 5 and 'batch="2"' in text  # n=2 requests ran as batches of 2
    finally:
        svc.close()


def test_compiled_service_compiles_each_batch_size_before_serving(monkeypatch):
    """`serve --backend torch --compile`: the transformer is compiled once, then run at every batch size the batcher
    can form (1, 2, 3 for max_batch 3) before the first request; a batch of 3 samples runs padded to its bucket,
    and what a client gets equals a single run. (torch.compile is counted here, not run: compiling is torch's;
    the padding and the warm-up are ours.)"""
    import torch

    from fluxtrt.runtime.batching import batch_buckets

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda module, **kw: compiled.append(module) or module)
    assert batch_buckets(8) == (1, 2, 4, 8) and batch_buckets(3) == (1, 2, 3) and batch_buckets(1) == (1,)
    from fluxtrt.runtime.executors import TorchExecutor

    seen = []  # the transformer's (batch, tokens) at warm-up: compiled at --size, not at the default 1024x1024
    real_infer = TorchExecutor.infer
    monkeypatch.setattr(TorchExecutor, "infer", lambda self, feeds: (
        seen.append(tuple(feeds["hidden_states"].shape[:2])) if self.component == "transformer" else None,
        real_infer(self, feeds))[1])
    svc = Service(PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32", compile=True), max_batch=3,
                  max_queue=4, size="256x192")
    try:
        ex = svc.pipe.executors["transformer"]
        assert len(compiled) >= 1 and ex.batch_buckets == (1, 2, 3) and svc.batcher.max_batch == 3
        assert seen == [(1, 192), (2, 192), (3, 192)] and svc.default_size == (192, 256)  # 16x12 latent patches
        status, payload, _ = asyncio.run(svc.generate(b'{"prompt": "a cat", "n": 3, "steps": 2, "seed": 5}'))
        assert status == 200
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["data"][2]["b64_json"]))))
        alone = svc.pipe.generate(["a cat"], 192, 256, 2, 3.5, seed=7).images[0]
        assert img.shape == (192, 256, 3) and diff(img, alone) <= MAX_UINT8_DIFF
    finally:
        svc.close()
    with pytest.raises(FluxtrtError, match=r"^width 250 is not a positive multiple of 16; use 240 or 256$"):
        Service(PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32"), max_batch=1, max_queue=4,
                size="250x256")


# --- fluxtrt serve on Ray Serve, over loopback -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engines(engines):
    """conftest's fp32 engines of tiny (shared with the other suites)."""
    return engines("tiny")[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def answered(future, timeout=180):
    """A request's status code, or "cut" where the connection closed inside the answer: a replica killed between
    the response's headers and its body (Ray's proxy had sent the headers) is an answer too, not a hang."""
    import http.client

    try:
        return future.result(timeout=timeout)[0]
    except (http.client.IncompleteRead, ConnectionError):
        return "cut"

class Server:
    def __init__(self, engines: Path | None, *args: str):
        """`fluxtrt serve` on `engines` with ONNX Runtime (None: what `args` name, e.g. --model M --backend torch)."""
        pytest.importorskip("ray")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        what = ["--engines", str(engines), "--backend", "onnxruntime"] if engines is not None else []
        # started with SIGINT ignored, as a shell's background job is: Ctrl-C must stop it all the same
        self.proc = subprocess.Popen([sys.executable, "-m", "fluxtrt.cli", "serve", *what, "--port", str(self.port),
                                      *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        self.output = []
        deadline = time.time() + 180
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            self.output.append(line)
            if "serving on" in line:  # from here on a thread drains the pipe: a full one would block the server
                threading.Thread(target=lambda: self.output.extend(iter(self.proc.stdout.readline, "")),
                                 daemon=True).start()
                return
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError("fluxtrt serve did not start:\n" + "".join(self.output[-20:]))

    def post(self, body, timeout=120):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + "/v1/images/generations", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:  # ours are JSON; Ray's proxy answers a dead replica in plain text
            body = e.read()
            try:
                return e.code, json.loads(body or b"{}"), dict(e.headers)
            except ValueError:
                return e.code, {"proxy": body.decode(errors="replace")}, dict(e.headers)

    def health(self, timeout=10):
        with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
            return json.loads(r.read())

    def stop(self, timeout=60) -> float:
        t0 = time.time()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.time() - t0


def decode(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))))


@pytest.mark.slow
def test_batcher_matches_single_runs_onnxruntime(tiny_engines):
    check_batched_equals_single(open_pipeline(tiny_engines, backend="onnxruntime"), lambda p: ContinuousBatcher(p))


def test_stop_deadline_ends_the_process():
    """After Ctrl-C `fluxtrt serve` ends by its deadline whatever Ray does: the timer thread exits with 130."""
    code = "import time\nfrom fluxtrt.serving import _exit_by\n_exit_by(1, print)\ntime.sleep(60)"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 130 and "did not stop within 1 s" in proc.stdout and time.time() - t0 < 10, proc


@pytest.mark.slow
def test_server_under_load_bad_requests_killed_replica_and_ctrl_c(tiny_engines, tmp_path):
    server = Server(tiny_engines, "--max-batch", "4")
    try:
        rng = np.random.default_rng()
        reqs = random_requests(rng, 64)
        bodies = [{"prompt": p, "size": f"{w}x{h}", "steps": s, "guidance": g, "seed": seed, "n": n}
                  for p, h, w, s, g, seed, n in reqs]
        with ThreadPoolExecutor(16) as pool:  # 16 concurrent clients
            answers = list(pool.map(server.post, bodies))
        assert [a[0] for a in answers] == [200] * 64, [a for a in answers if a[0] != 200][:2]
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            batches = [int(ln.split('batch="')[1].split('"')[0]) for ln in r.read().decode().splitlines()
                       if ln.startswith("fluxtrt_batch_steps_total")]
        assert max(batches) > 1  # requests shared transformer calls
        pipe = open_pipeline(tiny_engines, backend="onnxruntime")
        for (prompt, h, w, steps, g, seed, n), (_, payload, _) in zip(reqs, answers):
            assert [d["seed"] for d in payload["data"]] == list(range(seed, seed + n))  # none lost or duplicated
            for d in payload["data"]:
                alone = pipe.generate([prompt], h, w, steps, g, seed=d["seed"]).images[0]
                assert diff(decode(d), alone) <= MAX_UINT8_DIFF

        for body, code, message in [(b"{bad", 400, "not valid JSON"), ({"prompt": 3}, 400, "non-empty string"),
                                    ({"prompt": "a", "size": "4096x4096"}, 400, "outside the engines' range"),
                                    ({"prompt": "a", "steps": 1.5}, 400, '"steps" must be an integer')]:
            status, payload, _ = server.post(body)
            assert status == code and message in payload["error"]["message"], payload
        status, payload, _ = server.post({"prompt": "a", "stpes": 2, "sead": 5})
        assert status == 400 and 'unknown field "stpes" (did you mean "steps"?)' in payload["error"]["message"]
        try:  # a GET on the generate path: the API's JSON error shape, not FastAPI's
            urllib.request.urlopen(server.url + "/v1/images/generations", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 405 and "use POST" in json.loads(e.read())["error"]["message"]
        check_clients_that_give_up_are_cancelled(server)
        for body, code in [(b'{"prompt": "' + b"a" * 200_000 + b'"}', 413), (b"[" * 10_000 + b"]" * 10_000, 400),
                           ('{"prompt": "a", "size": "\uff15\uff11\uff12x512"}'.encode(), 400)]:
            status, payload, _ = server.post(body)
            assert status == code and "message" in payload["error"], (status, payload)
        second = subprocess.run([sys.executable, "-m", "fluxtrt.cli", "serve", "--engines", str(tiny_engines),
                                 "--backend", "onnxruntime", "--port", str(server.port)], capture_output=True, text=True,
                                timeout=60)  # the port is taken: refused before Ray starts, not shared
        assert second.returncode == 2 and "another program" in second.stdout + second.stderr, second
        check_readme_serve_example(server, tmp_path)
        assert server.post({"prompt": "a cat", "size": "256x256", "steps": 1})[0] == 200  # still serving

        pid = server.health()["pid"]
        with ThreadPoolExecutor(8) as pool:
            pending = [pool.submit(server.post, {"prompt": "a cat", "size": "256x256", "steps": 4, "seed": k})
                       for k in range(8)]
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)  # the replica dies mid-load; Ray restarts it
            codes = [answered(f) for f in pending]  # every request is answered: none hangs
        assert all(c in (200, "cut") or 500 <= c < 600 for c in codes), codes
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if server.health()["pid"] != pid:
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(1)
        assert server.post({"prompt": "a dog", "size": "256x256", "steps": 1})[0] == 200  # the new replica serves
    finally:
        seconds = server.stop()
    assert server.proc.returncode == 130 and seconds < 30, \
        f"Ctrl-C took {seconds:.1f} s; the server's last words:\n" + "".join(server.output[-15:])


def check_clients_that_give_up_are_cancelled(server):
    """Three clients give up after 1 s on {"steps": 1000, "n": 8} (hours of work for this machine): Ray Serve cancels
    their handlers, the replica drops their samples at the next step, the queue empties and a normal request is
    answered at once, not after them."""
    heavy = {"prompt": "a cat", "size": "256x256", "steps": 1000, "n": 8}
    with ThreadPoolExecutor(3) as pool:
        gone = [pool.submit(server.post, heavy, 1.0) for _ in range(3)]
        for f in gone:
            with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
                f.result()
    t0 = time.time()
    assert server.post({"prompt": "a dog", "size": "256x256", "steps": 1}, timeout=60)[0] == 200
    assert time.time() - t0 < 60
    deadline = time.time() + 30
    while (health := server.health())["queued"] and time.time() < deadline:
        time.sleep(0.5)
    assert health["queued"] == 0 and health["cancelled"] >= 3, health


def check_readme_serve_example(server, tmp_path):
    """The README's serve example: its request body (with 4 steps instead of 28, to keep CI short) and its
    decoder, run as written with this Python (3.10's grammar checked too), write img-7.png and img-8.png."""
    import ast
    import shlex

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "/v1/images/generations" in b)
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    body = json.loads(words[words.index("-d") + 1])
    decoder = words[words.index("-c", words.index("python3")) + 1]
    ast.parse(decoder, feature_version=(3, 10))
    status, payload, _ = server.post(dict(body, steps=4), timeout=300)
    assert status == 200, payload
    subprocess.run([sys.executable, "-c", decoder], input=json.dumps(payload), text=True, check=True, cwd=tmp_path)
    for item in payload["data"]:
        saved = np.asarray(Image.open(tmp_path / f"img-{item['seed']}.png"))
        w, h = (int(v) for v in body["size"].split("x"))
        assert saved.shape == (h, w, 3) and diff(saved, decode(item)) == 0
    assert sorted(p.name for p in tmp_path.glob("img-*.png")) == [f"img-{body['seed'] + i}.png" for i in range(body["n"])]


@pytest.mark.slow
def test_two_replicas_serve_together(tiny_engines):
    server = Server(tiny_engines, "--replicas", "2")
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(server.post, [{"prompt": "a cat", "size": "256x256", "steps": 3, "seed": k}
                                                  for k in range(16)]))
        assert [a[0] for a in answers] == [200] * 16
        assert len({a[2].get("X-Fluxtrt-Replica") or a[2].get("x-fluxtrt-replica") for a in answers}) == 2
    finally:
        server.stop()


# --- the Ray Serve application builder: serve run, Serve config files, KubeRay -----------------------------------

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,message", [
    ({"engines": "x", "max_batch": "four"}, "max_batch='four': expected an integer"),
    ({"model": "tiny", "backend": "torch", "cache_threshold": True}, "expected a number"),
    ({"model": "tiny", "backend": "torch", "replicas": "0"}, "replicas must be at least 1"),
    ({"model": "tiny", "backend": "torch", "port": "80"}, "unknown argument port"),
    ({"model": "tiny"}, "add --backend torch"),
    ({"engines": ["a"]}, "expected a string"),
    ({"model": "tiny", "backend": "torch", "compile": "maybe"}, "compile='maybe': expected true or false"),
    ({"engines": "x", "backend": "onnxruntime", "compile": "true"}, "compile=true compiles the PyTorch transformer"),
    ({"model": "tiny", "backend": "torch", "size": "big"}, 'size must be "WIDTHxHEIGHT" in pixels'),
    ({"model": "tiny", "backend": "torch", "size": "0x512"}, "size must be positive pixels"),
    ({"model": "tiny", "backend": "torch", "lora": [{"name": "x"}]}, "lora=[{'name': 'x'}]: expected a string or a list"),
    ({"model": "tiny", "backend": "torch", "lora": "x.safetensors:12"}, "--lora x.safetensors: the scale after ':'"),
    ({"engines": "x", "backend": "onnxruntime", "lora_dir": "."}, "--lora-dir on engines merges each request's LoRAs "
                                                                   "into your checkpoint: add --weights"),
    ({"model": "tiny", "backend": "torch", "lora_dir": "/no/such/folder"}, "--lora-dir /no/such/folder is not a folder"),
    ({"model": "tiny", "backend": "torch", "lora_cache_gb": "-1"}, "lora_cache_gb"),
    ({"model": "tiny", "backend": "torch", "parallel": "9"}, "--parallel takes 1 to 8 ranks, got 9"),
    ({"model": "tiny", "backend": "torch", "parallel": "2", "parallel_attention": "ring"},
     "--parallel-attention takes auto, ulysses, gather, got 'ring'"),
    ({"model": "tiny", "backend": "torch", "parallel": "2", "lora_dir": "."}, "--lora-dir with --parallel: per-request"),
    ({"model": "tiny", "backend": "torch", "parallel": "4", "gpus_per_replica": "2"},
     "--parallel 4 runs one rank per GPU: gpus_per_replica 2.0 is too few"),
])
def test_app_builder_arguments_are_one_line(args, message):
    from fluxtrt.serving import ServeArgs

    with pytest.raises(FluxtrtError, match=re.escape(message)):
        ServeArgs.parse(args)


def test_app_builder_types_its_arguments_and_builds_the_application():
    """`serve run fluxtrt.serving:app k=v` passes strings: they are typed; the result is a bound Serve app whose
    deployment is the FluxService the config files name."""
    pytest.importorskip("ray")
    from ray.serve import Application

    from fluxtrt.serving import ServeArgs, app

    args = ServeArgs.parse({"model": "tiny", "backend": "torch", "max_batch": "2", "cache_threshold": "0.2",
                            "gpus_per_replica": "0", "torch_dtype": "fp32", "compile": "true"})
    assert (args.max_batch, args.cache_threshold, args.gpus_per_replica, args.pipeline.compile) == (2, 0.2, 0.0, True)
    assert ServeArgs.parse({"model": "tiny", "backend": "torch", "compile": False}).pipeline.compile is False
    loras = ServeArgs.parse({"model": "tiny", "backend": "torch", "lora": ["a.safetensors:0.5", "b.safetensors"]})
    assert [(r.path.name, r.scale) for r in loras.pipeline.lora] == [("a.safetensors", 0.5), ("b.safetensors", 1.0)]
    built = app({"model": "tiny", "backend": "torch", "gpus_per_replica": "0"})
    assert isinstance(built, Application)
    # --parallel N: one replica owns N GPUs in one placement group bundle on one node
    split = ServeArgs.parse({"model": "tiny", "backend": "torch", "parallel": "4", "gpus_per_replica": "4"})
    assert split.placement() == {"ray_actor_options": {"num_gpus": 4.0, "num_cpus": 1},
                                 "placement_group_bundles": [{"CPU": 1, "GPU": 4.0}],
                                 "placement_group_strategy": "STRICT_PACK"}
    assert ServeArgs.parse({"model": "tiny", "backend": "torch", "gpus_per_replica": "1"}).placement() == \
        {"ray_actor_options": {"num_gpus": 1.0, "num_cpus": 1}}
    assert isinstance(app({"model": "tiny", "backend": "torch", "parallel": "2", "gpus_per_replica": "0"}),
                      Application)


def test_serve_config_and_kuberay_service_name_the_same_application():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "docs" / "serve-config.yaml").read_text())
    ServeDeploySchema(**config)
    service = yaml.safe_load((ROOT / "docs" / "kuberay-rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["applications"] == config["applications"]
    (application,) = config["applications"]
    assert application["import_path"] == "fluxtrt.serving:app"
    assert [d["name"] for d in application["deployments"]] == ["FluxService"]
    from fluxtrt.serving import ServeArgs

    assert set(application["args"]) <= set(ServeArgs.keys())


@pytest.mark.slow
def test_serve_run_with_the_config_file_serves(tiny_engines, tmp_path):
    """Ray's own `serve run` on docs/serve-config.yaml (engines pointed at a real build, no GPU, a free port):
    the app imports, loads and answers like `fluxtrt serve`."""
    import yaml

    config = yaml.safe_load((ROOT / "docs" / "serve-config.yaml").read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    app_cfg = config["applications"][0]
    app_cfg["args"] = {"engines": str(tiny_engines), "backend": "onnxruntime", "gpus_per_replica": 0}
    app_cfg["deployments"] = [{"name": "FluxService", "num_replicas": 1}]
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).with_name("serve")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(serve_cli), "run", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline, status, payload = time.time() + 240, None, None
        while time.time() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/images/generations", method="POST",
                                             data=json.dumps({"prompt": "a cat", "size": "256x256", "steps": 2,
                                                              "seed": 3}).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    status, payload = r.status, json.loads(r.read())
                break
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(2)
        assert status == 200, (proc.poll(), proc.stdout.read() if proc.poll() is not None else "")
        alone = open_pipeline(tiny_engines, backend="onnxruntime").generate(["a cat"], 256, 256, 2, 3.5, seed=3).images[0]
        assert diff(np.asarray(Image.open(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"])))), alone) \
            <= MAX_UINT8_DIFF
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def write_loras(folder, names, seed_model="tiny-schnell", std=0.3):
    """One random rank-2..3 transformer LoRA per name (diffusers/peft format) over a few of tiny's layers."""
    import torch
    from safetensors.torch import save_file

    from fluxtrt.models.source import resolve_model

    raw = resolve_model(seed_model).load_component("transformer", torch.float32, "cpu")
    layers = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
              "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out", "proj_out")
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        rank, tensors = 2 + i % 2, {}
        for m in layers[i % 2:]:
            lin = raw.get_submodule(m)
            tensors[f"transformer.{m}.lora_A.weight"] = torch.randn(rank, lin.in_features, generator=g) * std
            tensors[f"transformer.{m}.lora_B.weight"] = torch.randn(lin.out_features, rank, generator=g) * std
        save_file(tensors, folder / f"{name}.safetensors")
    return folder


def test_a_compiled_server_compiles_each_batch_with_and_without_an_adapter_before_requests(tmp_path):
    """warm_up_batches with a LoraBank (what `serve --compile --lora-dir` runs at start; dynamo with a counting
    backend, tiny-schnell fp32): every batch bucket compiled without LoRA and with one adapter per sample, so a
    request's call with an adapter (a padded batch too) compiles nothing new; the bank is off afterwards, and the
    recompile limit covers the forms."""
    import torch
    import torch._dynamo

    from fluxtrt.runtime.assembly import open_pipeline
    from fluxtrt.runtime.batching import allow_compiled_forms, warm_up_batches
    from fluxtrt.runtime.lora import LoraBank

    pipe = open_pipeline(options=PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32"))
    bank = LoraBank(write_loras(tmp_path / "loras", ["a"]), 1 << 30, rows=4)
    ex = pipe.executors["transformer"]
    ex.serve_loras(bank)
    forms = []
    torch._dynamo.reset()
    ex._fn = torch.compile(ex.module, backend=lambda gm, _: forms.append(gm) or gm.forward, dynamic=False)
    allow_compiled_forms(3 * 2 * 2)
    cfg = torch._dynamo.config
    assert getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 0)) >= 12
    warm_up_batches(pipe, (2, 4), 128, 128, loras=bank)
    warmed = len(forms)
    assert warmed >= 4 and not bank.on
    bank.check("a")
    slots = bank.acquire([("a", float(np.random.default_rng().uniform(0.5, 1.5)))])
    from fluxtrt.components import ShapePoint

    for real in (1, 2, 3):  # 1 and 3: padded to the buckets of 2 and 4
        feeds = ex.spec.sample_inputs(ShapePoint(real, 128, 128), pipe.geo, int(np.random.default_rng().integers(99)))
        bank.use([slots] * real)
        try:
            with pipe.on_stream():
                ex.infer(feeds)
        finally:
            bank.use(None)
    assert len(forms) == warmed, (warmed, len(forms))


def test_requests_with_different_loras_share_batches_and_equal_their_single_runs(tmp_path):
    """tiny-schnell, fp32, CPU: eight concurrent requests, four LoRAs (one stacked with a scale) and none, on a
    server with batches of 4 and slots for 4 adapters (so some wait and some are evicted): each image equals
    `fluxtrt run --lora ...` with the same settings within 2/255; /health counts transformer calls that mixed
    adapters. A name outside the folder, a missing one and a damaged file are each one JSON 400, and the server
    keeps serving."""
    from fluxtrt.runtime.lora import MAX_STACK

    folder = write_loras(tmp_path / "loras", ["a", "b", "c", "d"])
    (folder / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    svc = Service(PipelineOptions(model="tiny-schnell", backend="torch", torch_dtype="fp32"), max_batch=4,
                  max_queue=64, lora_dir=folder, lora_cache_gb=1e-6)
    requests = [None, "a", "b", [{"name": "c", "scale": 0.5}, {"name": "a", "scale": -0.7}], "d", None, "b", "c"]
    try:
        assert svc.loras.slots == MAX_STACK
        from types import SimpleNamespace

        from fluxtrt.serving import FluxService

        listing = FluxService.loras(SimpleNamespace(service=svc))  # GET /v1/loras
        assert listing.status_code == 200
        assert [d["name"] for d in json.loads(listing.body)["data"]] == ["a", "b", "broken", "c", "d"]

        async def scenario():
            bodies = [json.dumps({"prompt": "a red fox", "size": "256x256", "steps": 3, "seed": 40 + i,
                                  **({"lora": r} if r is not None else {})}).encode() for i, r in enumerate(requests)]
            return await asyncio.gather(*(svc.generate(b) for b in bodies))

        answers = asyncio.run(scenario())
        assert [a[0] for a in answers] == [200] * len(requests), [a[1] for a in answers]
        health = svc.health()
        assert health["lora"]["mixed_calls"] > 0 and health["lora"]["calls"] >= health["lora"]["mixed_calls"], health
        for body, message in ((b'{"prompt": "x", "lora": "../loras/a"}', "is not a LoRA of this server"),
                              (b'{"prompt": "x", "lora": "missing"}', "'missing' is not a LoRA of this server"),
                              (b'{"prompt": "x", "lora": "broken"}', "is not a safetensors file"),
                              (b'{"prompt": "x", "lora": [{"name": "a", "scale": 99}]}', "within +-10"),
                              (b'{"prompt": "x", "lora": ["a", "a"]}', "names a LoRA twice")):
            status, payload, _ = asyncio.run(svc.generate(body))
            assert status == 400 and message in payload["error"]["message"], payload
        status, _, _ = asyncio.run(svc.generate(b'{"prompt": "a dog", "size": "256x256", "steps": 1, "lora": "d"}'))
        assert status == 200
    finally:
        svc.close()
    plain = open_pipeline(model="tiny-schnell", backend="torch", torch_dtype="fp32")
    for i, r in enumerate(requests):
        stack = [r] if isinstance(r, str) else r or []
        if stack:  # the LoRAs matter
            own = plain.generate(["a red fox"], 256, 256, 3, 0.0, seed=40 + i).images[0]
            assert np.abs(decode(answers[i][1]["data"][0]).astype(int) - own.astype(int)).max() > 10, (i, r)
        refs = [f"{folder / (s if isinstance(s, str) else s['name'])}.safetensors:{1.0 if isinstance(s, str) else s['scale']}"
                for s in stack]
        pipe = open_pipeline(model="tiny-schnell", backend="torch", torch_dtype="fp32", lora=refs)
        alone = pipe.generate(["a red fox"], 256, 256, 3, 0.0, seed=40 + i).images[0]
        assert np.abs(decode(answers[i][1]["data"][0]).astype(int) - alone.astype(int)).max() <= 2, (i, r)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "tiny-fill", "tiny-kontext"])
def test_openai_client_edits_equal_fluxtrt_run(engines, tmp_path, model):
    """The official OpenAI client's images.edit (multipart) on tiny engines, through the server's HTTP API in
    this process: img2img (tiny, with strength), Fill (a mask with alpha: transparent = edit) and Kontext. Each
    image equals `fluxtrt run` with the same inputs within 2/255 (the Fill run given the same mask as white =
    edit); a missing image, a corrupt upload and a text field for the image are JSON 400s first, and the
    server keeps serving."""
    openai = pytest.importorskip("openai")
    import httpx2
    from typer.testing import CliRunner

    from fluxtrt.cli import app
    from fluxtrt.serving import local_app
    from tests.core.test_workflows import random_image, random_mask

    _, folder, _ = engines(model)
    rng = np.random.default_rng()
    random_image(rng, 256, 256).save(tmp_path / "in.png")
    white = random_mask(rng, 256, 256)
    white.save(tmp_path / "mask.png")
    alpha = np.full((256, 256, 4), 255, np.uint8)
    alpha[..., 3] = np.where(np.asarray(white) == 255, 0, 255)  # OpenAI: transparent = edit
    Image.fromarray(alpha, "RGBA").save(tmp_path / "mask-alpha.png")
    extra = {"steps": 2, "seed": 9, **({"strength": 0.7} if model == "tiny" else {})}
    svc = Service(PipelineOptions(engines=folder, backend="onnxruntime"), max_batch=2, max_queue=8)
    try:
        async def scenario():
            http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=local_app(svc)), base_url="http://fluxtrt")
            client = openai.AsyncOpenAI(api_key="unused", base_url="http://fluxtrt/v1", http_client=http)
            mask = {"mask": (tmp_path / "mask-alpha.png").read_bytes()} if model == "tiny-fill" else {}
            bad = [await http.post("/v1/images/edits", files=files, data={"prompt": "x"})
                   for files in ({}, {"image": ("x.png", b"not an image", "image/png")})]
            bad.append(await http.post("/v1/images/edits", data={"prompt": "x", "image": "a path"}))
            got = await client.images.edit(image=("in.png", (tmp_path / "in.png").read_bytes(), "image/png"),
                                           prompt="a red fox", size="256x256", response_format="b64_json",
                                           extra_body=extra, **mask)  # after the 400s: it kept serving
            return got, bad

        got, bad = asyncio.run(scenario())
    finally:
        svc.close()
    assert [r.status_code for r in bad] == [400] * 3, [r.text for r in bad]
    assert all(set(r.json()) == {"error"} for r in bad)
    served = decode({"b64_json": got.data[0].b64_json})
    args = ["run", "--engines", str(folder), "--backend", "onnxruntime", "--prompt", "a red fox", "--image",
            str(tmp_path / "in.png"), "--height", "256", "--width", "256", "--steps", "2", "--seed", "9",
            "--out", str(tmp_path / "run.png")]
    args += ["--strength", "0.7"] if model == "tiny" else ["--mask", str(tmp_path / "mask.png")] if model == "tiny-fill" else []
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert np.abs(served.astype(int) - np.asarray(Image.open(tmp_path / "run.png")).astype(int)).max() <= 2


@pytest.mark.slow
def test_engine_loras_one_stack_per_call_equal_their_single_runs(engines, tmp_path):
    """On ONNX Runtime (which cannot mix adapters in a call), tiny's engines with --weights: six concurrent
    requests over two LoRAs, a stack of both and none; the batcher never puts two stacks in one call
    (mixed_calls 0, /health says so) and each image equals `fluxtrt run --backend onnxruntime --weights W --lora
    ...` with the same settings within 2/255. A missing name is one JSON 400, and the server keeps serving."""
    src, folder, _ = engines("tiny")
    loras = write_loras(tmp_path / "loras", ["a", "b"], seed_model="tiny")
    svc = Service(PipelineOptions(engines=folder, backend="onnxruntime", weights=src.path), max_batch=4, max_queue=64,
                  lora_dir=loras, lora_cache_gb=1e-6)
    requests = [None, "a", "b", "a", [{"name": "b", "scale": 0.5}, {"name": "a", "scale": -0.7}], None]
    try:
        async def scenario():
            bodies = [json.dumps({"prompt": "a red fox", "size": "256x256", "steps": 3, "seed": 60 + i,
                                  **({"lora": r} if r is not None else {})}).encode() for i, r in enumerate(requests)]
            return await asyncio.gather(*(svc.generate(b) for b in bodies))

        answers = asyncio.run(scenario())
        assert [a[0] for a in answers] == [200] * len(requests), [a[1] for a in answers]
        health = svc.health()["lora"]
        assert health["mixes_in_a_batch"] is False and health["mixed_calls"] == 0 and health["calls"] > 0, health
        status, payload, _ = asyncio.run(svc.generate(b'{"prompt": "x", "lora": "missing"}'))
        assert status == 400 and "'missing' is not a LoRA of this server" in payload["error"]["message"], payload
        assert asyncio.run(svc.generate(b'{"prompt": "a dog", "size": "256x256", "steps": 1, "lora": "b"}'))[0] == 200
    finally:
        svc.close()
    opened = {}
    for i, r in enumerate(requests):
        stack = [r] if isinstance(r, str) else r or []
        refs = tuple(f"{loras / (s if isinstance(s, str) else s['name'])}.safetensors:"
                     f"{1.0 if isinstance(s, str) else s['scale']}" for s in stack)
        if refs not in opened:
            opened[refs] = open_pipeline(folder, backend="onnxruntime", weights=src.path, lora=refs)
        alone = opened[refs].generate(["a red fox"], 256, 256, 3, 3.5, seed=60 + i).images[0]
        assert np.abs(decode(answers[i][1]["data"][0]).astype(int) - alone.astype(int)).max() <= 2, (i, r)
        if refs:  # the LoRAs matter
            own = opened[()].generate(["a red fox"], 256, 256, 3, 3.5, seed=60 + i).images[0]
            assert np.abs(alone.astype(int) - own.astype(int)).max() > 10, (i, r)
