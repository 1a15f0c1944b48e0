"""Pipeline parallelism through the whole engine on 8 fake CPU devices: offline throughput of
TP x PP = 8 x 1, 4 x 2 and 2 x 4, the pipeline's ticks and its bubble against the formula. PP 1
runs twice: with the engine's default 4 decode steps fused per engine step, and with 1 (as a
pipelined engine runs: one token per sequence per step).

Every configuration runs in its own process (8 fake CPU devices: `XLA_FLAGS`), under timeouts:
one engine (`load_format="dummy"`: random weights of `benchmarks.pipeline_bubbles`' model, 8
layers, hidden 512, MLP 2048, float32, the jnp attention reference), a warm-up run of the same
shape (other prompts, `WARMUP_TOKENS` tokens each), then the timed run: `REQUESTS` requests of
`PROMPT_LEN` random prompt tokens, `OUTPUT_LEN` greedy tokens each, EOS ignored, all added at once,
`max_num_seqs` = `REQUESTS`, stepped until all finish, `REPEATS` times (other prompts each time;
the median run is kept, every run's seconds listed). The processes start one after another and
stay up; the timed runs go in rounds over all configurations, so that the shared machine's
drifting load falls on each alike. Recorded: wall seconds, output tokens/s,
engine steps and ms per step (and of it, the seconds in the runner's `execute`: packing and
dispatch, drain ticks included, and in its `fetch`: waiting for results), and under PP > 1 the runner's ticks, drain ticks and bubble (the
stages' idle share of the ticks, from its counters), with the micro-batches that entered by
program (token bucket, decode or mixed) and the ticks on which none entered.

Bubble formula (carried pipeline): 0 while at least P groups of sequences take turns; each time
the pipeline fills and drains again (a forced drain before another shape or a KV copy, or the
end of the work) its stages idle (P - 1) ticks' worth in all, so formula = (P - 1) x fills / ticks.
Idle ticks in mid-stream (nothing to enter although micro-batches are in flight: fewer than P
groups of work) come on top of it. The in-step pipeline this replaced idled (P - 1) / P of every
decode step (one micro-batch per step, P ticks).

The greedy token ids must be the same for every configuration (a mismatch is printed loudly).

    python -m benchmarks.pipeline_engine [--output benchmarks/results/pipeline_engine_cpu.json]
"""

import argparse
import collections
import json
import os
import select
import subprocess
import sys
import tempfile
import time

from benchmarks.call_timing import time_calls
from benchmarks.pipeline_bubbles import CONFIG as MODEL_CONFIG
from benchmarks.results_files import save_results

# (TP, PP, num_scheduler_steps) over the same 8 devices: PP 1 with the engine's default fused decode
# steps (4 tokens per step) and without (1: as PP > 1 runs, one token per step)
CONFIGS = [(8, 1, 4), (8, 1, 1), (4, 2, 4), (2, 4, 4)]
REQUESTS, PROMPT_LEN, OUTPUT_LEN, WARMUP_TOKENS = 32, 64, 32, 8
REPEATS = 3  # timed runs per configuration (other prompts each): the median run is kept
STARTUP_TIMEOUT_S, RUN_TIMEOUT_S = 150, 60  # per configuration's start-up and warm-up, per run
CONFIG = {**MODEL_CONFIG, "model_type": "llama", "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}


def prompts(seed: int) -> list[list[int]]:
    """`REQUESTS` prompts of `PROMPT_LEN` tokens, random from `seed` (distinct: no prefix hits)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(3, CONFIG["vocab_size"], (REQUESTS, PROMPT_LEN)).tolist()


def generate(engine, seed: int, max_tokens: int) -> tuple[float, int, dict[int, list[int]]]:
    """Adds all requests, steps until they finish: (seconds, engine steps, token ids per request)."""
    from jaxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts(seed)):
        engine.add_request(f"{seed}-{i}", {"prompt_token_ids": prompt}, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
        steps += 1
    return time.perf_counter() - start, steps, tokens


def child(model_dir: str, tp: int, pp: int, num_steps: int, max_num_batched_tokens: int) -> None:
    """One configuration's engine and warm-up (in this process: 8 fake devices), then the timed
    runs the parent asks for on stdin, each answered with its row on stdout."""
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.engine_args import EngineArgs

    started = time.perf_counter()
    engine = LLMEngine(
        EngineArgs(
            model=model_dir,
            load_format="dummy",
            dtype="float32",
            skip_tokenizer_init=True,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            max_model_len=PROMPT_LEN + OUTPUT_LEN,
            max_num_seqs=REQUESTS,
            max_num_batched_tokens=max_num_batched_tokens,
            num_scheduler_steps=num_steps,
            compilation_cache_dir="none",
        )
    )
    startup = time.perf_counter() - started
    runner = engine.runner
    entered, kinds = collections.Counter(), collections.Counter()  # per program; per step
    fills = [0]
    if pp > 1:  # every tick: the program that entered (or none), and the pipeline emptying
        feed, advance = runner.feed, runner.feed.advance

        def recorded_advance(entering):
            leaving = advance(entering)
            if entering is not None:
                key = entering.key
                entered[f"{'decode' if key.decode else 'mixed'} {key.tokens}"] += 1
            else:
                entered["none"] += 1
            if not feed.in_flight:
                fills[0] += 1
            return leaving

        feed.advance = recorded_advance
    execute, seconds_in = runner.execute, collections.Counter()  # seconds in execute and fetch
    time_calls(runner, "fetch", lambda s: seconds_in.update(fetch=s))

    def recorded_execute(output):
        if output.is_empty:
            kinds["empty"] += 1
        elif all(len(s.token_ids) == 1 for s in output.step_inputs):
            kinds["decode"] += 1
        else:
            kinds["prefill/mixed"] += 1
        start = time.perf_counter()
        try:
            return execute(output)
        finally:
            seconds_in["execute"] += time.perf_counter() - start

    runner.execute = recorded_execute
    warm_s, warm_steps, _ = generate(engine, 1, WARMUP_TOKENS)
    ready = {
        "tp": tp,
        "pp": pp,
        "num_scheduler_steps": num_steps,
        "startup_s": round(startup, 1),
        "compile_s": round(engine.compile_seconds, 1) if engine.compile_seconds is not None else None,
        "warmup_s": round(warm_s, 2),
        "warmup_steps": warm_steps,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:  # "run K": timed run K (prompts from seed 10 + K); its row, as a line
        if not line.startswith("run "):
            break
        seed = 10 + int(line.split()[1])
        print(json.dumps(timed_run(engine, runner, pp, seed, entered, kinds, seconds_in, fills)), flush=True)


def timed_run(engine, runner, pp, seed, entered, kinds, seconds_in, fills) -> dict:
    """One timed run of the workload (prompts from `seed`), the recorders reset before it."""
    base = (runner.num_ticks, runner.num_drain_ticks, runner.busy_stage_ticks) if pp > 1 else None
    entered.clear(), kinds.clear(), seconds_in.clear()
    fills[0] = 0
    seconds, steps, tokens = generate(engine, seed, OUTPUT_LEN)
    row = {
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(REQUESTS * OUTPUT_LEN / seconds, 1),
        "steps": steps,
        "ms_per_step": round(1000 * seconds / steps, 1),
        "execute_ms_per_step": round(1000 * seconds_in["execute"] / steps, 1),
        "fetch_ms_per_step": round(1000 * seconds_in["fetch"] / steps, 1),
        "steps_by_kind": dict(kinds),
        "tokens": [tokens[i] for i in range(REQUESTS)],
    }
    if pp > 1:
        ticks = runner.num_ticks - base[0]
        busy = runner.busy_stage_ticks - base[2]
        row |= {
            "ticks": ticks,
            "drain_ticks": runner.num_drain_ticks - base[1],
            "ms_per_tick": round(1000 * seconds / ticks, 1),
            "bubble_measured": round(1 - busy / (ticks * pp), 4),
            "fills": fills[0],
            "bubble_formula": round((pp - 1) * fills[0] / ticks, 4),
            "in_step_decode_bubble": round((pp - 1) / pp, 4),
            "entered_by_program": dict(entered),
        }
    return row


class Config:
    """A configuration's child process, started and warmed up; `ask` has it run once more."""

    def __init__(self, model_dir: str, tp: int, pp: int, num_steps: int, max_num_batched_tokens: int):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        command = [sys.executable, "-m", "benchmarks.pipeline_engine", "--child", model_dir]
        command += [str(tp), str(pp), str(num_steps), "--max-num-batched-tokens", str(max_num_batched_tokens)]
        self.row = {"tp": tp, "pp": pp, "num_scheduler_steps": num_steps}
        self.runs: list[dict] = []
        self.stderr = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1
        )
        self._read(STARTUP_TIMEOUT_S, self.row.update)

    @property
    def failed(self) -> bool:
        return "error" in self.row

    def ask(self, k: int) -> None:
        """Timed run `k` (its row kept in `runs`), unless the process failed before."""
        if not self.failed:
            self.process.stdin.write(f"run {k}\n")
            self.process.stdin.flush()
            self._read(RUN_TIMEOUT_S, self.runs.append)

    def _read(self, timeout: float, keep) -> None:
        """Passes the child's next JSON line to `keep`; on a timeout or an exit, kills it and
        records why in `row["error"]`."""
        deadline, why = time.monotonic() + timeout, f"timed out after {timeout} s"
        while select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            line = self.process.stdout.readline()
            if line.startswith("{"):
                keep(json.loads(line))
                return
            if not line:  # (other lines: anything else the child printed)
                why = f"exit {self.process.wait()}"
                break
        self.close()
        self.stderr.seek(0)
        self.row["error"] = f"{why}: {self.stderr.read()[-2000:]}"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def result(self) -> dict:
        """Its row: the start-up's, then the median run's (every run's seconds and tokens listed)."""
        if self.failed or not self.runs:
            return self.row | ({} if self.failed else {"error": "no runs"})
        median = sorted(self.runs, key=lambda r: r["seconds"])[len(self.runs) // 2]
        return (
            self.row
            | {"seconds_all_runs": [r["seconds"] for r in self.runs]}
            | median
            | {"tokens": [r["tokens"] for r in self.runs]}
        )


def table(rows: list[dict]) -> str:
    lines = [
        "| TP x PP | decode steps fused | wall s | output tok/s | vs 8 x 1 | vs 8 x 1 unfused | steps | ms per step "
        "| of it in execute | in fetch | ticks | drain ticks | fills | bubble: formula | measured | in-step decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fused = r["num_scheduler_steps"] if r["pp"] == 1 else "1 (PP fuses none)"
        name = f"| {r['tp']} x {r['pp']} | {fused} |"
        if "error" in r:
            lines.append(f"{name} {r['error'][:60]} |" + " |" * 13)
            continue
        pipelined = (
            f"{r['ticks']} | {r['drain_ticks']} | {r['fills']} | {r['bubble_formula']:.3f} | "
            f"{r['bubble_measured']:.3f} | {r['in_step_decode_bubble']:.2f} |"
            if r["pp"] > 1
            else f"{r['steps']} | - | - | 0 | 0 | 0 |"
        )
        lines.append(
            f"{name} {r['seconds']:.2f} | {r['output_tokens_per_s']:.0f} | {r.get('vs_pp1', float('nan')):.2f}x | "
            f"{r.get('vs_pp1_unfused', float('nan')):.2f}x | {r['steps']} | {r['ms_per_step']:.1f} | "
            f"{r['execute_ms_per_step']:.1f} | {r['fetch_ms_per_step']:.1f} | {pipelined}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="benchmarks/results/pipeline_engine_cpu.json")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--child", nargs=4, metavar=("MODEL_DIR", "TP", "PP", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_dir, *numbers = args.child
        child(model_dir, *map(int, numbers), args.max_num_batched_tokens)
        return 0
    load_before = os.getloadavg()
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    configs = []  # started one after another (their compiles do not overlap), then kept idle
    for tp, pp, num_steps in CONFIGS:
        configs.append(Config(model_dir, tp, pp, num_steps, args.max_num_batched_tokens))
        print(json.dumps(configs[-1].row)[:300], flush=True)
    for k in range(REPEATS):  # rounds over all configurations: drifting load falls on each alike
        for c in configs:
            c.ask(k)
            print(f"round {k} {c.row['tp']} x {c.row['pp']}: {c.runs[-1]['seconds'] if c.runs else c.row}", flush=True)
    for c in configs:
        c.close()
    rows = [c.result() for c in configs]
    load_after = os.getloadavg()
    fused, unfused = rows[0], rows[1]
    mismatches = []
    for r in rows:
        if "error" in r:
            mismatches.append(f"{r['tp']} x {r['pp']}: no tokens ({r['error'][:200]})")
            continue
        for key, ref in (("vs_pp1", fused), ("vs_pp1_unfused", unfused)):
            if "error" not in ref:
                r[key] = round(r["output_tokens_per_s"] / ref["output_tokens_per_s"], 3)
        if "error" not in fused:
            differ = [
                f"run {k} request {i}"
                for k, (run, ref) in enumerate(zip(r["tokens"], fused["tokens"]))
                for i, (a, b) in enumerate(zip(run, ref))
                if a != b
            ]
            r["tokens_match_pp1"] = not differ
            if differ:
                mismatches.append(f"{r['tp']} x {r['pp']} (fused {r['num_scheduler_steps']}): requests {differ}")
    if mismatches:
        print("!" * 72 + "\nGREEDY TOKENS DIFFER from TP 8 x PP 1 (or are missing):\n" + "\n".join(mismatches))
        print("!" * 72)
    report = {
        "command": " ".join(["python -m benchmarks.pipeline_engine", *sys.argv[1:]]),
        "model": CONFIG,
        "workload": {
            "requests": REQUESTS,
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
            "max_num_seqs": REQUESTS,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "warmup_output_len": WARMUP_TOKENS,
        },
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "greedy_tokens_identical": not mismatches,
        "mismatches": mismatches,
        "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "tokens_pp1_first_request": fused.get("tokens", [[None]])[0][0],
    }
    text = table(rows)
    save_results(args.output, report, text)
    print(text)
    print(f"load average before {report['load_average_before']}, after {report['load_average_after']}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
