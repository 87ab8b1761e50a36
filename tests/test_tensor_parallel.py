"""Tensor parallelism in the engine: two processes over gloo give one process's greedy tokens exactly (float32),
with prefix hits, chunked prefill and preemption; nothing leaks; a dead rank fails loudly, not by hanging."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.tensor_parallel import RankFailure

PREFIX = "def fibonacci(n):\n    " * 6  # shared by several prompts: prefix-cache hits
PROMPTS = [PREFIX + "return", PREFIX + "if n", "import os\n\n\ndef walk(path):", "class Stack:\n" * 12, "The quick"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
# Small steps and a small cache: long prompts are prefilled in chunks, and sequences are preempted.
TIGHT = {"dtype": "float32", "max_num_batched_tokens": 32, "num_kv_blocks": 14, "enable_tracing": False}


@pytest.fixture(scope="module")
def one_process_tokens():
    return [o.token_ids for o in LLM(**TIGHT).generate(PROMPTS, GREEDY)]


def test_two_ranks_give_one_process_greedy_tokens_with_prefix_hits_chunks_and_preemption(one_process_tokens):
    with LLM(tensor_parallel_size=2, **{**TIGHT, "enable_tracing": True}) as llm:
        llm.engine.parallel.comm.traffic.reset()
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == one_process_tokens
        # The trace tells each step's wait in collectives; over the steps it is all the time rank 0 waited.
        steps = {e.start_s: e.args["collective_s"] for e in llm.tracer.events if e.name in ("prefill", "decode")}
        assert (
            sum(steps.values()) == pytest.approx(llm.engine.parallel.comm.traffic.seconds) and min(steps.values()) > 0
        )
        stats = llm.stats()
        assert stats["kv_blocks_used"] == 0
        assert stats["prefix_cache_hit_rate"] > 0 and stats["num_preemptions"] > 0
        # each rank holds half the KV heads: the same blocks take half the bytes
        assert llm.engine.kv_bytes_per_token() * 2 == LLM(**TIGHT).engine.kv_bytes_per_token()
        workers = llm.engine.parallel.workers
    assert [w.exitcode for w in workers] == [0]  # leaving the block closed the engine: the rank exited, reaped
    llm.close()  # and closing again is harmless


def test_a_script_without_a_main_guard_starts_its_ranks(tmp_path):
    """Spawned ranks do not run the user's script again, so the guard multiprocessing usually needs is not."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from minserve import LLM, SamplingParams\n"
        "llm = LLM(tensor_parallel_size=2, enable_tracing=False)\n"
        "out = llm.generate(['def add(a, b):'], SamplingParams(max_tokens=3, ignore_eos=True))[0]\n"
        "print('tokens', len(out.token_ids))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens 3" in done.stdout and "bootstrapping" not in done.stderr


def test_a_rank_that_dies_fails_the_engine_with_a_clear_error():
    shared_memory = set(os.listdir("/dev/shm"))
    llm = LLM(tensor_parallel_size=2, **TIGHT)
    worker = llm.engine.parallel.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(RankFailure, match=r"rank\(s\) \{1: -9\}.*start a new one"):
        llm.generate(PROMPTS[:2], GREEDY)
    with pytest.raises(RankFailure):  # and at once afterwards, without waiting on a timeout
        llm.generate(PROMPTS[:1], GREEDY)
    llm.engine.shutdown()
    assert not worker.is_alive()
    assert set(os.listdir("/dev/shm")) <= shared_memory  # no segment left behind by the dead rank


def test_a_size_that_does_not_divide_the_heads_fails_before_any_rank_starts():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide.*sizes that work: 1, 2"):
        LLM(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="compile_model and speculative_config"):
        LLM(tensor_parallel_size=2, compile_model=True)


def test_minserve_serve_with_two_ranks_answers_an_openai_client_as_one_process_does():
    import openai

    from minserve.serve.launch import ServerProcess

    reference = LLM(dtype="float32").generate(["def fibonacci(n):"], SamplingParams(max_tokens=12, temperature=0))
    with ServerProcess(["--tensor-parallel-size", "2", "--dtype", "float32"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        reply = client.completions.create(model="minserve-tiny", prompt="def fibonacci(n):", max_tokens=12,
                                          temperature=0)  # fmt: skip
        started = _descendants_of(server.pid)
    assert reply.choices[0].text == reference[0].text
    assert len(started) >= 2  # the engine core, and the rank it started
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker takes a moment to notice
    while (left := [pid for pid in started if pathlib.Path(f"/proc/{pid}").exists()]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left  # the core, its rank and the tracker all stopped with the server


def test_torchrun_starts_the_ranks_and_rank_0_gives_one_process_text():
    """Across machines a launcher starts every rank (one machine here): the same command on each, rank 0 runs
    the engine and the others serve it as workers; a launch of the wrong size is refused, naming the fix."""
    # torchrun gives each rank one torch thread; its --standalone rendezvous picks a free port on this machine.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "minserve.cli", "generate", "def fibonacci(n):", "--raw", "--dtype", "float32", "--max-tokens", "12",
               "--temperature", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    reference = LLM(dtype="float32").generate(["def fibonacci(n):"], SamplingParams(max_tokens=12, temperature=0))
    for size_flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        run = subprocess.run([*command, size_flag, "2"], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout == "def fibonacci(n):" + reference[0].text + "\n"
    wrong = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert wrong.returncode != 0 and "the launcher started 2 processes (WORLD_SIZE)" in wrong.stderr
    assert "def fibonacci(n):" not in wrong.stdout  # rank 0 refused too, rather than serve as one process


def test_torchrun_stopped_mid_stream_drains_it_and_no_rank_reads_as_a_failure(tmp_path):
    """torchrun passes a SIGTERM on to every rank. Rank 0's server drains what it streams; the other rank and
    rank 0's engine core wait for rank 0 to say stop, so the drain finishes and nothing logs a failed core."""
    import httpx

    from minserve.serve.launch import free_port

    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "minserve.cli", "serve", "--tensor-parallel-size", "2", "--port", str(port)]  # fmt: skip
    log_path = tmp_path / "torchrun.log"
    with log_path.open("wb") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": "minserve-tiny", "prompt": "def drain():", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            launcher.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]", rest[-2:]
        assert '"completion_tokens":200' in rest[-2].replace(" ", "")
        launcher.wait(120)
        log_text = log_path.read_text(errors="replace")
        assert "engine core failed" not in log_text and "restarted" not in log_text, log_text[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_worker_that_exits_before_joining_fails_the_start_naming_it(monkeypatch):
    """Rank 0 watches the workers it spawned while they start: one that exits on the way (an import that
    fails, a GPU it cannot take) is named at once, not waited for until the join times out."""
    import multiprocessing

    from minserve.engine import workers

    monkeypatch.setattr(workers, "COLLECTIVE_TIMEOUT_S", 60.0)  # the other outcome: "did not start within 60 s"
    store = workers._listen(2)
    dying = multiprocessing.get_context("spawn").Process(target=sys.exit, args=(3,))
    dying.start()
    with pytest.raises(RankFailure, match=r"tensor parallelism: rank\(s\) \{1: 3\} .* exited before joining"):
        workers._wait_for_workers(store, [dying], "tensor parallelism")


def _descendants_of(pid: int) -> list[int]:
    """Processes still running whose parent chain reaches ``pid`` (from /proc: Linux)."""
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += frontier
    return found


@pytest.mark.slow
def test_smollm2_on_three_ranks_gives_one_process_greedy_tokens():
    """SmolLM2-135M-Instruct: 9 heads and 3 KV heads, so three ranks hold three heads and one KV head each."""
    chat = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    options = {"dtype": "float32", "enable_tracing": False, "num_kv_blocks": 16}
    one = LLM("smollm2-135m-instruct", **options)
    prompts = [one.tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name a prime number.")]  # fmt: skip
    expected = [o.token_ids for o in one.generate(prompts, chat)]
    kv_bytes = one.engine.kv_bytes_per_token()
    del one
    llm = LLM("smollm2-135m-instruct", tensor_parallel_size=3, **options)
    try:
        assert [o.token_ids for o in llm.generate(prompts, chat)] == expected
        assert llm.engine.kv_bytes_per_token() * 3 == kv_bytes  # one KV head of three per rank
    finally:
        llm.engine.shutdown()
