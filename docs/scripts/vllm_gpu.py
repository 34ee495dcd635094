"""vLLM on a GPU box without a package index, and kvbench's engine and load client measured against it.

Steps (each one call of a few minutes; state lives under --work, default /tmp/kvb-vllm):

  receive PARTS_DIR...     copy bundle parts (tools/engine_bundle.py) into WORK/parts
  setup                    unpack + verify the vLLM bundle, convert the default model's GGUF to an HF directory
                           (tools/gguf_to_hf.py), write the Llama-3-8B-shaped dummy directory
  accuracy                 kvbench sweep configs/vllm-fp8-kv-smol.yaml on the real weights, then report and gate
  sweep                    kvbench sweep configs/vllm-vs-kvbench-8b.yaml (both engines, one sweep), then report
  serve-vllm KV...         start vLLM servers on the dummy 8B shape (one per KV format, same KV memory) and leave
                           them running for `measure`
  serve-kvbench KV         start `kvbench serve` on the same shape, KV format and KV memory
  measure ENGINE KV        the loads against a running server: kvbench load (random token ids, and the shared
                           text prompts) and, for vLLM, `vllm bench serve` on the same text prompts; first, for
                           vLLM, the raw answers kvbench's fake must match (errors, stream chunks, scoring,
                           /metrics: probe.json, the source of tests/fixtures/vllm-0.26/)
  stop                     stop every server this script started

  python docs/scripts/vllm_gpu.py setup && python docs/scripts/vllm_gpu.py accuracy --out $OUT

Everything a step measures goes to --out (JSON + logs); `pack NAME` archives it with the server logs.
docs/external-engines.md ("A real vLLM") and docs/performance.md ("kvbench's engine against vLLM") hold what it
showed and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("KVB_VLLM_WORK", "/tmp/kvb-vllm"))
VP = WORK / "vp"  # the unpacked bundle
SMOL = WORK / "smol-hf"
DUMMY = WORK / "llama8b-dummy"
SERVED = "llama8b"
KV_GIB = 40  # the KV memory both engines get on the 8B shape (vLLM --kv-cache-memory-bytes, kvbench --kv-budget-gb)
MAX_LEN = 9216  # 8k prompts + 128 out, rounded up
PORTS = {("vllm", "bf16"): 8101, ("vllm", "fp8"): 8102, ("kvbench", "bf16"): 8111, ("kvbench", "fp8"): 8112}
VLLM_KV = {"bf16": "auto", "fp8": "fp8"}
KVB_KV = {"bf16": "bf16", "fp8": "fp8_e4m3"}
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
           "max_position_embeddings": 16384, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "dtype": "bfloat16", "torch_dtype": "bfloat16", "vocab_size": 49152}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, env=None, check=True, timeout=None, **kw) -> subprocess.CompletedProcess:
    log("$ " + (cmd if isinstance(cmd, str) else " ".join(map(str, cmd))))
    r = subprocess.run(cmd, shell=isinstance(cmd, str), env=env, timeout=timeout, text=True, **kw)
    if check and r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {cmd}")
    return r


def bundle_env() -> dict:
    env = dict(os.environ)
    r = subprocess.run([sys.executable, str(REPO / "tools/engine_bundle.py"), "env", str(VP)], capture_output=True, text=True)
    for line in r.stdout.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        env[k] = v
    env["PATH"] = f"{VP / 'bin'}:{WORK / 'bin'}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{WORK / 'kvb'}:{env.get('PYTHONPATH', '')}"
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kvbench_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{WORK / 'bin'}:{env.get('PATH', '')}"
    site = VP / "site"  # fastapi, uvicorn, gguf, ... for kvbench come from the bundle too
    env["PYTHONPATH"] = f"{WORK / 'kvb'}:{site}:{env.get('PYTHONPATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def install_kvbench() -> None:
    """kvbench from this checkout without pip: a package tree of links, and a `kvbench` launcher."""
    root = WORK / "kvb" / "kvbench"
    root.mkdir(parents=True, exist_ok=True)
    for d in ("core", "harness", "kernels", "runtime", "suites", "reports", "configs", "tools"):
        link = root / d
        if not link.exists():
            link.symlink_to(REPO / d)
    (WORK / "bin").mkdir(exist_ok=True)
    launcher = WORK / "bin" / "kvbench"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} -m kvbench.harness \"$@\"\n")
    launcher.chmod(0o755)


def wait_health(url: str, proc: subprocess.Popen | None, timeout: float, logfile: Path) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return time.time() - t0
        except Exception:
            pass
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log tail:\n" + logfile.read_text()[-4000:])
        time.sleep(1)
    raise SystemExit(f"server not healthy after {timeout:.0f}s; log tail:\n" + logfile.read_text()[-4000:])


def save(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1) if not isinstance(data, str) else data)


# ------------------------------------------------------------------------------------------------- steps
def step_receive(args) -> None:
    dest = WORK / "parts"
    dest.mkdir(parents=True, exist_ok=True)
    for d in args.parts:
        for f in sorted(Path(d).glob("*")):
            if f.is_file():
                shutil.copy2(f, dest / f.name)
                log(f"received {f.name} ({f.stat().st_size / 1e6:.1f} MB)")
    install_kvbench()


def step_setup(args) -> None:
    install_kvbench()
    if not (VP / "site" / "vllm").is_dir():
        sh([sys.executable, str(REPO / "tools/engine_bundle.py"), "unpack", str(WORK / "parts"), "--dest", str(VP),
            "--remove-parts", "--no-verify"], check=False)
    r = sh([sys.executable, str(REPO / "tools/engine_bundle.py"), "verify", str(VP)], capture_output=True, check=False)
    print(r.stdout + r.stderr[-2000:])
    save(Path(args.out), "bundle_verify.txt", r.stdout)
    gguf = next(iter((VP / "files").glob("*.gguf")), None) if (VP / "files").is_dir() else None
    if gguf and not (SMOL / "model.safetensors").exists():
        sh([sys.executable, "-m", "kvbench.tools.gguf_to_hf", str(gguf), str(SMOL)], env=kvbench_env())
    elif not (SMOL / "tokenizer.json").exists() and (REPO / ".scratch/smol-tok").is_dir():
        shutil.copytree(REPO / ".scratch/smol-tok", SMOL, dirs_exist_ok=True)  # the tokenizer alone (load runs)
    DUMMY.mkdir(parents=True, exist_ok=True)
    (DUMMY / "config.json").write_text(json.dumps(LLAMA8B, indent=1))
    for f in SMOL.glob("*"):
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json", "generation_config.json"):
            shutil.copy2(f, DUMMY / f.name)


def step_accuracy(args) -> None:
    if not (Path(args.data_dir) / "gsm8k_test.jsonl").is_file():
        raise SystemExit(f"--data-dir {args.data_dir} has no gsm8k_test.jsonl: carry a copy of the GSM8K data there "
                         "(docs/external-engines.md) or pass --data-dir")
    env = bundle_env()
    env["KVBENCH_SMOL_HF"] = str(SMOL)
    run = Path(args.out) / "run-smol"
    t0 = time.time()
    sh(["kvbench", "sweep", str(REPO / "configs/vllm-fp8-kv-smol.yaml"), "--out", str(run), "--no-progress",
        "--data-dir", args.data_dir], env=env, check=False)
    log(f"sweep took {time.time() - t0:.0f} s")
    sh(["kvbench", "report", str(run)], env=env, check=False)
    g = sh(["kvbench", "gate", str(run)], env=env, check=False)
    log(f"gate exit {g.returncode}")


def step_sweep(args) -> None:
    """configs/vllm-vs-kvbench-8b.yaml: both engines in one kvbench sweep (a launched server per engine and KV
    format), then report; --resume continues a sweep an earlier call left unfinished."""
    env = bundle_env()
    env["PYTHONPATH"] = f"{WORK / 'kvb'}:{VP / 'site'}:{env.get('PYTHONPATH', '')}"
    env.update(KVBENCH_LLAMA8B_DUMMY=str(DUMMY), KVBENCH_SMOL_HF=str(SMOL))
    run = Path(args.out) / "run-vs"
    t0 = time.time()
    cmd = ["kvbench", "sweep", str(REPO / "configs/vllm-vs-kvbench-8b.yaml"), "--out", str(run), "--no-progress"]
    cmd += ["--resume"] if (run / "manifest.json").exists() else []
    log("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:  # Ctrl-C: the sweep stops its servers; finished cells stay for --resume
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
    log(f"sweep call took {time.time() - t0:.0f} s")
    sh(["kvbench", "report", str(run)], env=env, check=False)


def _probe_requests(base: str, model: str) -> dict:
    """Raw answers of the real server to what kvbench sends and to bad requests."""
    def call(method, path, body=None, raw=False):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return {"status": r.status, "body": r.read().decode("utf-8", "replace")[:20000]}
        except urllib.error.HTTPError as e:
            return {"status": e.code, "body": e.read().decode("utf-8", "replace")[:4000]}

    out = {}
    out["models"] = call("GET", "/v1/models")
    out["tokenize"] = call("POST", "/tokenize", {"prompt": "The capital of France is", "add_special_tokens": True})
    out["stream_completion"] = call("POST", "/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 6,
                                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    out["stream_chat"] = call("POST", "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    out["echo_logprobs"] = call("POST", "/v1/completions", {"model": model, "prompt": [1, 504, 3458, 282, 4649, 314], "max_tokens": 1,
                                "temperature": 0, "echo": True, "logprobs": 5, "return_tokens_as_token_ids": True})
    out["err_unknown_model"] = call("POST", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    out["err_bad_json"] = call("POST", "/v1/completions", b"{not json")
    out["err_too_long"] = call("POST", "/v1/completions", {"model": model, "prompt": "hello " * 12000, "max_tokens": 2})
    out["err_max_tokens_negative"] = call("POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1})
    out["err_logprobs_too_many"] = call("POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 1, "logprobs": 50})
    out["reset_prefix_cache"] = call("POST", "/reset_prefix_cache")
    out["metrics"] = call("GET", "/metrics")
    return out


def spawn(cmd: list[str], env: dict, logfile: Path, port: int) -> subprocess.Popen:
    """A server in its own session (it outlives this call until `stop`), its pid under WORK/pids/PORT."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    f = open(logfile, "w")
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    # run from WORK, not the checkout: its top-level folders (kernels/, core/, tools/, ...) would be importable
    # from the working directory as packages of those names by anything the server probes for
    proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=WORK)
    (WORK / "pids").mkdir(parents=True, exist_ok=True)
    (WORK / "pids" / f"{port}").write_text(str(proc.pid))
    return proc


def start_server(cmd: list[str], env: dict, logfile: Path, port: int, timeout: float) -> tuple[subprocess.Popen, float]:
    proc = spawn(cmd, env, logfile, port)
    return proc, wait_health(f"http://127.0.0.1:{port}", proc, timeout, logfile)


def stop_port(port: int) -> None:
    p = WORK / "pids" / f"{port}"
    if p.exists():
        try:
            os.killpg(int(p.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
        p.unlink()


def step_serve_vllm(args) -> None:
    env = bundle_env()
    out = Path(args.out)
    procs = []
    for kv in args.kv:
        port = PORTS[("vllm", kv)]
        logfile = WORK / "logs" / f"vllm-{kv}.log"
        cmd = ["vllm", "serve", str(DUMMY), "--load-format", "dummy", "--served-model-name", SERVED, "--host", "127.0.0.1",
               "--port", str(port), "--kv-cache-dtype", VLLM_KV[kv], "--attention-backend", "FLASH_ATTN",
               "--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(KV_GIB * 2**30), "--max-num-seqs", "256",
               "--gpu-memory-utilization", "0.45"] + (["--enforce-eager"] if args.eager else [])
        procs.append((kv, port, spawn(cmd, env, logfile, port), logfile, time.time()))
    for kv, port, p, logfile, t0 in procs:
        wait_health(f"http://127.0.0.1:{port}", p, 540, logfile)
        log(f"vllm {kv} healthy after {time.time() - t0:.0f} s")
        save(out, f"vllm-{kv}-startup.json", {"startup_s": round(time.time() - t0, 1)})
        shutil.copy2(logfile, out / logfile.name)


def step_serve_kvbench(args) -> None:
    env = kvbench_env()
    out = Path(args.out)
    for kv in args.kv:
        port = PORTS[("kvbench", kv)]
        logfile = WORK / "logs" / f"kvbench-{kv}.log"
        cmd = ["kvbench", "serve", "--model", "synthetic:llama-3-8b,vocab=49152", "--served-model-name", SERVED,
               "--kv-dtype", KVB_KV[kv], "--kv-scales", "unit", "--backend", "triton", "--kv-budget-gb", str(KV_GIB),
               "--max-running", "256", "--max-batched-tokens", "8192", "--max-model-len", str(MAX_LEN), "--port", str(port)]
        _, up = start_server(cmd, env, logfile, port, 540)
        log(f"kvbench {kv} healthy after {up:.0f} s")
        save(out, f"kvbench-{kv}-startup.json", {"startup_s": round(up, 1)})
        shutil.copy2(logfile, out / logfile.name)


def write_prompts(path: Path, n: int, tokens: int, seed: int) -> None:
    """``n`` text prompts of ``tokens`` SmolLM2 tokens each (random common words, cut at the token count and
    decoded), as custom-JSONL lines: what both load clients read."""
    import random

    from tokenizers import Tokenizer

    from kvbench.suites.ruler.words import COMMON_WORDS

    tok = Tokenizer.from_file(str(SMOL / "tokenizer.json"))
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            text = " ".join(rng.choice(COMMON_WORDS) for _ in range(tokens))
            ids = tok.encode(text, add_special_tokens=False).ids[:tokens]
            f.write(json.dumps({"prompt": tok.decode(ids), "output_tokens": 128}) + "\n")


LEVELS = ((16, 64), (64, 256), (256, 512))  # (concurrency, prompts)


def step_measure(args) -> None:
    engine, kv = args.engine, args.kv
    port = PORTS[(engine, kv)]
    base = f"http://127.0.0.1:{port}"
    env = bundle_env() if engine == "vllm" else kvbench_env()
    out = Path(args.out) / f"{engine}-{kv}"
    out.mkdir(parents=True, exist_ok=True)
    prompts = WORK / "prompts-1024.jsonl"
    sys.path.insert(0, str(WORK / "kvb"))
    if not prompts.exists():
        write_prompts(prompts, 512 + 8, 1024, 0)
    rows = []

    def flush():
        if engine == "vllm":
            try:
                urllib.request.urlopen(urllib.request.Request(base + "/reset_prefix_cache", method="POST", data=b""), timeout=30)
            except Exception as e:  # noqa: BLE001
                log(f"reset_prefix_cache: {e}")

    if engine == "vllm":  # what kvbench's fakes must answer like: stream chunks, scoring, error bodies, /metrics
        save(out, "probe.json", _probe_requests(base, SERVED))
    levels = [(c, n) for c, n in LEVELS if c in args.concurrency]
    for c, n in [] if args.clients_only else levels:  # kvbench load, random token ids (exact lengths)
        flush()
        t0 = time.time()
        sh(["kvbench", "load", "--base-url", base, "--model", SERVED, "--max-concurrency", str(c), "--num-prompts", str(n),
            "--input-len", "1024", "--output-len", "128", "--dataset", "random", "--warmup", "4", "--no-progress",
            "--tokenizer", "none", "--salt", f"{kv}-{c}", "--out", str(out / f"kvb-random-c{c}")], env=env, check=False)
        rows.append({"client": "kvbench", "dataset": "random ids", "c": c, "wall_s": round(time.time() - t0, 1)})
    if args.long:
        flush()
        sh(["kvbench", "load", "--base-url", base, "--model", SERVED, "--max-concurrency", "16", "--num-prompts", "32",
            "--input-len", "8192", "--output-len", "128", "--dataset", "random", "--warmup", "2", "--no-progress",
            "--tokenizer", "none", "--salt", f"{kv}-long", "--out", str(out / "kvb-random-long")], env=env, check=False)
    if engine == "vllm" and not args.skip_clients:
        # the same text prompts through both clients, 4 warm-up requests each, in the order kvbench, vllm, vllm,
        # kvbench, ... (repeat r runs them reversed when r is odd) so neither client always goes first
        for c, n in levels:
            for r in range(args.repeats):
                order = ("kvbench", "vllm") if r % 2 == 0 else ("vllm", "kvbench")
                for client in order:
                    flush()
                    if client == "kvbench":
                        sh(["kvbench", "load", "--base-url", base, "--model", SERVED, "--max-concurrency", str(c),
                            "--num-prompts", str(n), "--dataset", "custom", "--dataset-path", str(prompts),
                            "--output-len", "128", "--warmup", "4", "--no-progress",
                            "--out", str(out / f"kvb-custom-c{c}-r{r}")], env=env, check=False)
                    else:
                        sh(["vllm", "bench", "serve", "--backend", "vllm", "--base-url", base, "--endpoint",
                            "/v1/completions", "--model", SERVED, "--tokenizer", str(SMOL), "--dataset-name", "custom",
                            "--dataset-path", str(prompts), "--custom-output-len", "128", "--skip-chat-template",
                            "--disable-shuffle", "--num-prompts", str(n), "--num-warmups", "4", "--max-concurrency", str(c),
                            "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
                            "--save-result", "--save-detailed", "--result-dir", str(out),
                            "--result-filename", f"vllm-custom-c{c}-r{r}.json"], env=env, check=False, timeout=400)
    if engine == "vllm":
        try:
            save(out, "metrics.txt", urllib.request.urlopen(base + "/metrics", timeout=10).read().decode())
        except Exception:
            pass
    save(out, "steps.json", rows)


def step_pack(args) -> None:
    """WORK/out and WORK/logs as one archive under $OUT (the device returns few files, two folders deep)."""
    import tarfile

    dest = Path(os.environ.get("OUT", "/tmp")) / f"{args.name}.tgz"
    with tarfile.open(dest, "w:gz") as t:
        for sub in ("out", "logs"):
            d = WORK / sub
            if d.is_dir():
                for f in sorted(d.rglob("*")):
                    if f.is_file() and f.stat().st_size < 20e6:
                        t.add(f, arcname=str(f.relative_to(WORK)))
    log(f"packed {dest} ({dest.stat().st_size / 1e6:.1f} MB)")


def step_stop(args) -> None:
    for p in (WORK / "pids").glob("*") if (WORK / "pids").exists() else []:
        stop_port(int(p.name))
        log(f"stopped server on port {p.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(WORK / "out"), help="results (default WORK/out; `pack` archives it into $OUT)")
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("receive")
    r.add_argument("parts", nargs="+")
    sub.add_parser("setup")
    sw = sub.add_parser("sweep")
    sw.add_argument("--timeout", type=float, default=None, help="stop the sweep after this many seconds (resume later)")
    a = sub.add_parser("accuracy")
    a.add_argument("--data-dir", default=os.environ.get("KVBENCH_DATA_DIR", str(REPO / ".scratch/data")),
                   help="GSM8K copies for the fidelity texts (a folder with gsm8k_test.jsonl, e.g. ../shared/data carried "
                        "to the GPU machine; default $KVBENCH_DATA_DIR, else .scratch/data)")
    v = sub.add_parser("serve-vllm")
    v.add_argument("kv", nargs="+", choices=list(VLLM_KV))
    v.add_argument("--eager", action="store_true", help="--enforce-eager (starts in under a minute; no CUDA graphs)")
    k = sub.add_parser("serve-kvbench")
    k.add_argument("kv", nargs="+", choices=list(KVB_KV))
    m = sub.add_parser("measure")
    m.add_argument("engine", choices=["vllm", "kvbench"])
    m.add_argument("kv", choices=list(VLLM_KV))
    m.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256])
    m.add_argument("--long", action="store_true", help="also 8192-token prompts at concurrency 16")
    m.add_argument("--skip-clients", action="store_true", help="no client comparison (vLLM only)")
    m.add_argument("--clients-only", action="store_true", help="only the client comparison (vLLM only)")
    m.add_argument("--repeats", type=int, default=2, help="client comparison runs per client and level (alternating order)")
    sub.add_parser("stop")
    pk = sub.add_parser("pack")
    pk.add_argument("name")
    args = ap.parse_args()
    steps = {"receive": step_receive, "setup": step_setup, "accuracy": step_accuracy, "sweep": step_sweep,
             "serve-vllm": step_serve_vllm, "serve-kvbench": step_serve_kvbench, "measure": step_measure, "stop": step_stop, "pack": step_pack}
    steps[args.step](args)


if __name__ == "__main__":
    main()
