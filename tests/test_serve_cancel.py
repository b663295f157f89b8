"""The web page cancels: a generation stops between tokens when its client has gone or its time is up (and frees its
place and memory), a request estimated over the memory budget is refused with 413 before it starts, and a burst of
30 generation requests with half the clients gone keeps the server under its budget and frees every place within the
time limit. Also the library's hook (`should_stop`, `relevancy.core.cancel`)."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from language_models import save_tiny_llama
from test_serve import live_server, refused

import relevancy
from relevancy.core.cancel import Cancelled, cancellable, stopping
from relevancy.apps.serve import Limits, create_app, load_catalog, make_samples
from relevancy.apps.serve import jobs

PROMPT = "the cat sat on"
BUDGET_MB = 256
#: seconds each forward of the tiny model's first layer takes in the burst (so a job outlives a gone client)
STEP_S = 0.02


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    folder = save_tiny_llama(tmp_path_factory.mktemp("llama"))
    return load_catalog(["shapes"], text="none", pairs="none", language=str(folder))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------------------------------------- the library's hook
def test_a_generation_stops_between_tokens_and_leaves_the_model_as_it_was(catalog):
    entry = catalog.language
    before = {k: v.clone() for k, v in entry.model.state_dict().items()}
    asked = []

    def after_three() -> bool:
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(Cancelled, match="should_stop answered True"):
        relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=8, should_stop=after_three)
    assert len(asked) == 4  # before the work, then after each generated token
    with pytest.raises(Cancelled):  # and between backward rounds of a forced continuation (no tokens generated)
        relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, continuation=" the mat" * 6,
                                     should_stop=lambda: len(asked) > 5 or bool(asked.append(1)))
    asked.clear()
    with pytest.raises(Cancelled):  # and between the per-token backward rounds of an attention method's shared forward
        relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, continuation=" the mat" * 3, method="generic_attention",
                                     should_stop=lambda: len(asked) > 3 or bool(asked.append(1)))
    assert len(asked) == 4  # answered False before the work and three tokens' rounds, True at the fourth round
    assert not entry.model.training and all(torch.equal(v, before[k]) for k, v in entry.model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in entry.model.modules())
    whole = relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=4, should_stop=lambda: False)
    plain = relevancy.explain_generation(entry.model, entry.tokenizer, PROMPT, max_new_tokens=4)
    assert torch.equal(whole.scores, plain.scores)


def test_the_hook_is_per_call_and_checked():
    with pytest.raises(TypeError, match="should_stop must be a callable"):
        with stopping(True):  # type: ignore[arg-type]
            pass

    @cancellable
    def work() -> str:
        return "done"

    assert work() == "done" and work(should_stop=lambda: False) == "done"
    with pytest.raises(Cancelled):
        work(should_stop=lambda: True)
    assert "should_stop" in str(relevancy.explain_generation.__wrapped__.__doc__)


# ---------------------------------------------------------------------------------------------- the memory budget
def test_a_request_over_the_memory_budget_is_refused_before_it_starts(catalog, monkeypatch):
    started = []
    monkeypatch.setattr(jobs, "explained", lambda *a, **k: started.append(1))
    limits = Limits(max_running=1, max_memory_mb=1, max_text_chars=2_000)
    with TestClient(create_app(catalog, make_samples(scenes=2, pairs=1), limits)) as client:
        long = {"prompt": "the cat sat on the mat " * 80, "max_new_tokens": 8}
        tokens = len(catalog.language.tokenizer(long["prompt"])["input_ids"]) + 8
        config = catalog.language.model.config
        estimate = 4 * jobs.ATTENTION_COPIES * tokens ** 2 * config.num_attention_heads * config.num_hidden_layers
        assert estimate > 2**20
        refused(client.post("/api/explain-generation", json=long), 413, "budget is 1 MiB for 1 explanations at once")
        assert client.post("/api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 2}).status_code == 200
        big = Limits(max_running=2, max_memory_mb=1, max_pixels=10**8)
        assert big.request_bytes == 2**19
    with TestClient(create_app(catalog, make_samples(scenes=2, pairs=1), Limits(max_running=1, max_memory_mb=1))) as client:
        import base64
        import io

        from PIL import Image

        buffer = io.BytesIO()
        Image.new("RGB", (400, 400)).save(buffer, "PNG")  # 160,000 pixels x 16 B = 2.4 MiB
        image = {"data": base64.b64encode(buffer.getvalue()).decode()}
        refused(client.post("/api/explain", json={"image": image, "methods": ["rollout"]}), 413, "the images would take about 2.44 MiB")
    assert not started  # refused before any work


# ---------------------------------------------------------------------------------------------- the burst
def test_a_burst_with_half_the_clients_gone_stays_under_the_budget_and_frees_every_place(catalog, monkeypatch):
    limits = Limits(max_running=2, max_waiting=28, max_per_client=30, time_limit_s=20, max_memory_mb=BUDGET_MB)
    app = create_app(catalog, make_samples(scenes=2, pairs=1), limits)
    gate = app.state.gate
    layer = catalog.language.model.model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: time.sleep(STEP_S))  # each token a little work
    outcomes: list[str] = []
    real = relevancy.generation.explain_generation

    def counted(*args, **kwargs):
        try:
            result = real(*args, **kwargs)
        except Cancelled:
            outcomes.append("cancelled")
            raise
        outcomes.append("finished")
        return result

    monkeypatch.setattr(relevancy.generation, "explain_generation", counted)
    peak = [0.0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.01)

    answers: list[tuple[bool, int | str]] = []
    try:
        with live_server(app) as url:
            with httpx.Client(base_url=url, timeout=30) as warm:  # the first generation's one-off costs, outside the burst
                assert warm.post("api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 2}).status_code == 200
            outcomes.clear()
            baseline = rss_mib()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()

            def client(leaves: bool) -> None:
                # a client that leaves gives up after 0.3 s: httpx closes the connection, the server sees it go
                with httpx.Client(base_url=url, timeout=0.3 if leaves else 60) as http:
                    try:
                        status: int | str = http.post("api/explain-generation", json={"prompt": PROMPT, "max_new_tokens": 32}).status_code
                    except httpx.TimeoutException:
                        status = "gone"
                answers.append((leaves, status))

            leaving = [True, True] + [False, True] * 13 + [False, False]  # 15 of 30 leave
            threads = [threading.Thread(target=client, args=(leaves,)) for leaves in leaving]
            for k, thread in enumerate(threads):
                thread.start()
                if k == 1:  # two clients that will leave hold both slots when they go: their jobs must stop
                    time.sleep(0.1)
            for thread in threads:
                thread.join()
            answered = time.monotonic()
            while gate.admitted or gate.running:  # every place and slot free again
                assert time.monotonic() - answered < limits.time_limit_s, (gate.admitted, outcomes)
                time.sleep(0.01)
            freed = time.monotonic() - answered
            sampling.set()
            sampler.join()
    finally:
        handle.remove()
    stayed = [status for leaves, status in answers if not leaves]
    left = [status for leaves, status in answers if leaves]
    assert len(answers) == 30 and set(stayed) <= {200, 504} and stayed.count(200) >= 10, answers
    assert set(left) == {"gone"}, answers
    # the gone clients' jobs stopped: none ran to its end unasked (a few finish in the instant their client leaves)
    assert outcomes.count("finished") <= stayed.count(200) + 2 and "cancelled" in outcomes, outcomes
    assert len(outcomes) < 30  # the gone clients still waiting for a slot never started
    assert peak[0] - baseline < BUDGET_MB, (baseline, peak[0])
    assert freed < limits.time_limit_s
    print(f"burst: {stayed.count(200)} answered, {outcomes.count('cancelled')} jobs stopped, {outcomes.count('finished')} finished, "
          f"RSS {baseline:.0f} -> peak {peak[0]:.0f} MiB, every place free {freed:.2f} s after the last client")
