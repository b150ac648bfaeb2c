"""`pdserve bench gpu-check` (`make gpu-check`): pdserve on one GPU, checked, in one JSON report.

Three sections, each side by side with its reference, within one time budget (default 7 min
after the wheels are installed, on one H200 from a bare machine):

- `parity`: greedy output of pdserve's engine on CUDA equals transformers' `generate` on CUDA,
  token for token, for tiny random checkpoints of every supported architecture (float32; the
  bf16 agreement rate is reported beside it, not required).
- `cluster`: a 1P1D cluster (scheduler, one prefill and one decode engine, both on the one GPU
  with a share of its memory each, KV pulled GPU to GPU over UCX) answers greedy prompts with
  exactly the in-process engine's tokens, and the KV really moved (transferred_tokens > 0).
- `transfer`: KV pulls between two processes over UCX (`cuda_ipc`) for 16-1024 blocks beside
  a device-to-device copy in one process (the physical limit), the explicit host bounce
  (`--kv-staging host`, labelled) and NIXL's VRAM READ where its wheel is installed.
- `vllm_layouts`: the vLLM engine's path without vLLM (`bench/gpu_check_vllm.py`): CUDA KV in
  each of vLLM 0.32's six layouts, allocated as vLLM allocates it, registered in place as the
  connector registers it, moved between two processes byte-exact (whole blocks into TP 1, head
  ranges into TP 2), a run of blocks timed beside the device-to-device copy.
- `cuda_tests`: the test files with CUDA cases (`CUDA_TESTS`: they skip without a GPU and say
  that this check runs them) under pytest, in a process group ended at the section's limit;
  passed / failed / skipped with every skip's reason. Skipped with the reason where pytest or
  the files are absent.

The report's `environment.carry` is what a device run carries (tracked tree + `.whl`, the
64 MiB limit; `tools/device_carry.py`).

Every section runs in a process of its own under a hard time limit (`--section-limit-s`, never
past the overall budget): a section that stalls — a hung collective, a UCX endpoint that never
connects — is ended (SIGTERM, which stops a cluster it started, then SIGKILL) and reported with
the reason, and the report is written either way. `PDSERVE_GPU_CHECK_STALL=<section>` makes that
section hang, to exercise this path.

`--dry-run` runs every section on the CPU at tiny sizes (what `make test` runs, so the script
cannot rot while no GPU is lent; `cuda_tests` then only collects its files); the report says
`"device": "cpu", "dry_run": true` and the transfer baseline is then a host memcpy. Exit status 0 only when every section passed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.device_carry import measure as measure_carry
from bench.gpu_check_vllm import ALL_LAYOUTS, check_vllm_layouts

SECTIONS = ("parity", "cluster", "transfer", "vllm_layouts", "cuda_tests")
KINDS = ("llama_gqa_llama3", "qwen2_bias", "llama_tied_mqa_headdim", "mistral")
TINY_VOCAB = 512
ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class CheckContext:
    device: str  # "cuda", or "cpu" for --dry-run
    dry_run: bool
    workdir: Path
    deadline: float
    args: argparse.Namespace
    models: dict[str, Path] = field(default_factory=dict)

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="gpu-check.json", help="the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny sizes (no GPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for all sections; later ones are skipped")
    parser.add_argument("--section-limit-s", type=float, default=240.0,
                        help="hard limit of one section (also never past the budget): a stalled section is ended "
                             "and reported")
    parser.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per parity / cluster prompt")
    parser.add_argument("--sizes", default="16,64,256,1024", help="blocks per KV pull in the transfer section")
    parser.add_argument("--iters", type=int, default=5, help="timed pulls per size and method (median)")
    parser.add_argument("--workdir", default="", help="where the tiny checkpoints and cluster logs go (default: temp)")
    parser.add_argument("--wheel-dir", default=".whl", help="the wheels a device run carries beside the tree (measured)")
    parser.add_argument("--vllm-layouts", default=",".join(ALL_LAYOUTS),
                        help="vLLM KV layouts the vllm_layouts section moves (dry run: BHLNC,LBHNC)")


def run(args: argparse.Namespace) -> int:
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS) or args.iters < 1 or args.budget_s <= 0 or args.section_limit_s <= 0:
        raise ValueError(f"--sections must name only {SECTIONS}; --iters >= 1; --budget-s > 0; --section-limit-s > 0")
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda":
        _require_cuda()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    ctx = CheckContext(device, args.dry_run, workdir, time.monotonic() + args.budget_s, args)
    report: dict[str, Any] = {"device": device, "dry_run": args.dry_run,
                              "environment": environment(device, args.wheel_dir), "sections": {}}
    started = time.monotonic()
    for name in sections:
        report["sections"][name] = _run_section(name, ctx)
        _write(report, started, Path(args.out))
    ok = all(s.get("ok") for s in report["sections"].values())
    report["ok"] = ok
    _write(report, started, Path(args.out))
    _print_summary(report, Path(args.out))
    return 0 if ok else 1


def _require_cuda() -> None:
    from engine.device import DeviceUnavailableError, missing_cuda_message, probe_host

    host = probe_host()
    if host.num_gpus == 0:
        raise DeviceUnavailableError(missing_cuda_message(host) + " (or run with --dry-run)")


STALL_ENV = "PDSERVE_GPU_CHECK_STALL"
TERM_GRACE_S = 20.0


def _run_section(name: str, ctx: CheckContext) -> dict[str, Any]:
    """Runs one section in a spawned process under min(--section-limit-s, budget left); its
    result, or why it has none (an exception, a stall ended at the limit, a crash)."""
    if ctx.remaining_s() <= 0:
        return {"ok": False, "skipped": "the time budget ran out before this section"}
    limit = min(ctx.args.section_limit_s, ctx.remaining_s())
    _log(f"{name}: starting (limit {limit:.0f} s, {ctx.remaining_s():.0f} s of budget left)")
    t0 = time.monotonic()
    spawn = mp.get_context("spawn")
    receiver, sender = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_section_main, args=(name, ctx, sender), name=f"gpu-check-{name}")
    proc.start()
    sender.close()
    result = _await_section(proc, receiver, limit)
    result["seconds"] = round(time.monotonic() - t0, 2)
    _log(f"{name}: {'ok' if result.get('ok') else 'FAILED'} in {result['seconds']} s")
    return result


def _await_section(proc: Any, receiver: Connection, limit: float) -> dict[str, Any]:
    result: dict[str, Any] | None = None
    if receiver.poll(limit):
        try:
            result = receiver.recv()
        except EOFError:  # the process died without an answer
            result = None
    if result is None and proc.is_alive():
        proc.terminate()  # SIGTERM: the section's `with` blocks stop what they started
        proc.join(TERM_GRACE_S)
        if proc.is_alive():
            proc.kill()
        proc.join()
        return {"ok": False, "error": f"stalled: no result within the section's limit of {limit:.0f} s; ended"}
    proc.join(TERM_GRACE_S)
    if result is None:
        return {"ok": False, "error": f"the section's process exited with status {proc.exitcode} and no result"}
    return result


def _section_main(name: str, ctx: CheckContext, sender: Connection) -> None:
    signal.signal(signal.SIGTERM, _exit_on_term)
    runners: dict[str, Callable[[CheckContext], dict[str, Any]]] = {
        "parity": check_parity, "cluster": check_cluster, "transfer": check_transfer,
        "vllm_layouts": check_vllm_section, "cuda_tests": check_cuda_tests}
    try:
        if os.environ.get(STALL_ENV) == name:
            while True:
                time.sleep(3600)
        result = runners[name](ctx)
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    sender.send(result)


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(f"ended by signal {signum}")


def _write(report: dict[str, Any], started: float, out: Path) -> None:
    report["total_seconds"] = round(time.monotonic() - started, 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


def _print_summary(report: dict[str, Any], out: Path) -> None:
    print(f"gpu-check on {report['device']}{' (dry run)' if report['dry_run'] else ''}: "
          f"{'PASSED' if report['ok'] else 'FAILED'} in {report['total_seconds']} s; report {out}")
    for name, section in report["sections"].items():
        status = "ok" if section.get("ok") else section.get("error") or "failed"
        if section.get("skipped"):
            status = f"skipped: {section['skipped']}"
        print(f"  {name:12s} {status}")
    transfer = report["sections"].get("transfer", {})
    for row in transfer.get("rows", []):
        cells = "  ".join(f"{m}={v:.1f}" if v is not None else f"{m}=-" for m, v in row["gbps"].items())
        print(f"    {row['num_blocks']:5d} blocks ({row['num_bytes'] / 2**20:8.1f} MiB)  GB/s: {cells}")
    vllm = report["sections"].get("vllm_layouts", {})
    for row in vllm.get("layouts", []):
        print(f"    vLLM {row['layout']}: whole blocks {'exact' if row['whole_blocks_exact'] else 'DIFFER'}, head ranges "
              f"{'exact' if row['head_ranges_exact'] else 'DIFFER'}; run of {vllm['run_blocks']} blocks "
              f"{row['run_gbps']} GB/s ({row['transport']}) vs copy {row['copy_gbps']} GB/s")
    tests = report["sections"].get("cuda_tests", {})
    if "counts" in tests:
        print(f"    CUDA tests: {tests['counts']}")
    carry = report["environment"].get("carry", {})
    if isinstance(carry, dict) and "mib" in carry:
        print(f"  carried to a device run: {carry['mib']} MiB of 64 ({carry['note']})")


def _log(text: str) -> None:
    print(f"[gpu-check] {text}", file=sys.stderr, flush=True)


def environment(device: str, wheel_dir: str = ".whl") -> dict[str, Any]:
    """Versions and hardware the report was made with (each probe may fail on its own)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "host": platform.node()}
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:  # what a device run carries (the tree + .whl, against 48 of its 64 MiB)
        env["carry"] = measure_carry(ROOT, ROOT / wheel_dir)
    except OSError as e:
        env["carry"] = f"unavailable: {e}"
    for name, probe in (("transformers", _version_of("transformers")), ("grpcio", _version_of("grpc")),
                        ("ucx", _ucx_version), ("ucx_transports", _ucx_transports), ("nixl", _nixl_version)):
        try:
            env[name] = probe()
        except Exception as e:
            env[name] = f"unavailable: {type(e).__name__}: {e}"
    return env


def _version_of(module: str) -> Callable[[], str]:
    def probe() -> str:
        return str(__import__(module).__version__)

    return probe


def _ucx_version() -> str:
    import ucxx._lib.libucxx as ucx_api

    return ".".join(map(str, ucx_api.get_ucx_version()))


def _ucx_transports() -> list[str]:
    import ucxx._lib.libucxx as ucx_api

    from connectors.ucx.device_memory import transports

    ctx = ucx_api.UCXContext(config_dict={"TLS": "^cma"}, feature_flags=(ucx_api.Feature.TAG,))
    return sorted(transports(ctx.info))


def _nixl_version() -> str:
    from importlib.metadata import version

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return f"{dist} {version(dist)}"
        except Exception:
            continue
    raise ImportError("no nixl wheel installed (too large to travel with the working tree)")


# -- tiny checkpoints ---------------------------------------------------------------------------

def tiny_checkpoint(kind: str, root: Path) -> Path:
    """A random tiny Hugging Face checkpoint of `kind` (seeded: the same weights every run)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common: dict[str, Any] = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0)
    builders: dict[str, tuple[Any, Any]] = {
        "llama_gqa_llama3": (LlamaConfig(num_attention_heads=4, num_key_value_heads=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common), LlamaForCausalLM),
        "qwen2_bias": (Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common),
                       Qwen2ForCausalLM),
        "llama_tied_mqa_headdim": (LlamaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                               tie_word_embeddings=True, **common), LlamaForCausalLM),
        "mistral": (MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common),
                    MistralForCausalLM),
    }
    config, cls = builders[kind]
    path = root / kind
    if not (path / "config.json").is_file():
        torch.manual_seed(1234)
        cls(config).eval().save_pretrained(path)
        _write_tokenizer(path)
    return path


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0".."t511"): the scheduler loads one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY_VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, TINY_VOCAB, (n,), generator=g).tolist() for n in lengths]


def _model(ctx: CheckContext, kind: str) -> Path:
    if kind not in ctx.models:
        ctx.models[kind] = tiny_checkpoint(kind, ctx.workdir / "models")
    return ctx.models[kind]


# -- (1) parity ---------------------------------------------------------------------------------

def check_parity(ctx: CheckContext) -> dict[str, Any]:
    kinds = KINDS[:1] if ctx.dry_run else KINDS
    lengths = [7, 40] if ctx.dry_run else [3, 70, 17, 33, 1, 52, 9, 25]
    rows = [_parity_row(ctx, kind, _prompts(lengths, seed=i + 1)) for i, kind in enumerate(kinds)]
    return {"ok": all(r["float32_equal"] for r in rows), "models": rows}


def _parity_row(ctx: CheckContext, kind: str, prompts: list[list[int]]) -> dict[str, Any]:
    path = _model(ctx, kind)
    n = ctx.args.new_tokens
    row: dict[str, Any] = {"model": kind, "prompts": len(prompts), "new_tokens": n}
    for dtype in ("float32", "bfloat16"):
        ref = hf_greedy(path, prompts, n, ctx.device, dtype)
        ours = pdserve_greedy(path, prompts, n, ctx.device, dtype, max_num_batched_tokens=40)
        same = sum(a == b for r, o in zip(ref, ours, strict=True) for a, b in zip(r, o, strict=True))
        row[f"{dtype}_equal"] = ours == ref
        row[f"{dtype}_token_agreement"] = round(same / (n * len(prompts)), 4)
        if dtype == "float32" and ours != ref:
            bad = next(i for i, (r, o) in enumerate(zip(ref, ours, strict=True)) if r != o)
            row["first_mismatch"] = {"prompt": bad, "transformers": ref[bad], "pdserve": ours[bad]}
    return row


def hf_greedy(path: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: str) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    del model
    return out


def pdserve_greedy(path: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: str,
                   **engine_kw: Any) -> list[list[int]]:
    """pdserve's engine, all prompts at once (chunked prefill mixed with decodes)."""
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLMEngine(path, device=device, dtype=dtype, kv_cache_memory="32MiB", block_size=8, torch_threads=4,
                   load_tokenizer=False, **engine_kw) as engine:
        return [list(t) for t in engine.generate(prompts, params)]


# -- (2) 1P1D cluster on one GPU -----------------------------------------------------------------

def check_cluster(ctx: CheckContext) -> dict[str, Any]:
    from services.client import Client
    from services.local_cluster import ClusterSpec, LocalCluster

    path = _model(ctx, "llama_gqa_llama3")
    prompts = _prompts([5, 33, 70, 12] if ctx.dry_run else [5, 33, 70, 12, 129, 40, 18, 90], seed=21)
    n = ctx.args.new_tokens
    expected = pdserve_greedy(path, prompts, n, ctx.device, "float32")
    engine_args = ["--device", ctx.device, "--transfer-timeout-s", "10"]
    if ctx.device == "cuda":
        engine_args += ["--gpu-memory-fraction", "0.05"]
    # --path-policy remote: every prompt is prefilled on the prefill engine and its KV pulled (this
    # section checks the disaggregated path, not the scheduler's choice of it).
    spec = ClusterSpec(model=str(path), num_prefill=1, num_decode=1, torch_threads=2, kv_cache_memory="32MiB",
                       scheduler_args=["--path-policy", "remote"],
                       dtype="float32", engine_args=engine_args, log_dir=str(ctx.workdir / "cluster-logs"),
                       engine_devices=["0", "0"] if ctx.device == "cuda" else [])
    rows: list[dict[str, Any]] = []
    with LocalCluster(spec) as cluster, Client(cluster.target) as client:
        for i, prompt in enumerate(prompts):
            r = client.generate(prompt, request_id=f"gpu-check-{i}", max_tokens=n, temperature=0.0,
                                ignore_eos=True, timeout=min(120.0, max(10.0, ctx.remaining_s())))
            rows.append({"prompt_tokens": len(prompt), "equal": r.token_ids == expected[i],
                         "transferred_tokens": r.transferred_tokens, "prefill": r.prefill_engine_id,
                         "decode": r.decode_engine_id})
        leaks = cluster.wait_no_leaks(timeout=10)
    ok = all(r["equal"] and r["transferred_tokens"] > 0 for r in rows) and not leaks
    return {"ok": ok, "requests": rows, "leaks": leaks, "engines_on": "one GPU, 0.05 of its memory each"
            if ctx.device == "cuda" else "cpu"}


# -- (4) vLLM's layouts, without vLLM ------------------------------------------------------------

def check_vllm_section(ctx: CheckContext) -> dict[str, Any]:
    layouts = ("BHLNC", "LBHNC") if ctx.dry_run else tuple(x for x in ctx.args.vllm_layouts.split(",") if x)
    return check_vllm_layouts(ctx.device, layouts=layouts, iters=2 if ctx.dry_run else ctx.args.iters)


# -- (5) the CUDA test files ----------------------------------------------------------------------

# Test files with CUDA cases that skip without a GPU, saying this check runs them.
CUDA_TESTS = (
    "tests/integration/ucx/test_ucx_device_memory.py",
    "tests/integration/ucx/test_ucx_vllm_layouts.py",
    "tests/unit/connectors/test_vllm_fence.py",
    "tests/unit/ucx/test_ucx_cuda_preflight.py",
    "tests/unit/engine_service/test_engine_loop_device.py",
    "tests/unit/connectors/test_offload.py::test_pool_is_pinned_where_the_cache_is_on_a_gpu",
)


def check_cuda_tests(ctx: CheckContext) -> dict[str, Any]:
    """Runs `CUDA_TESTS` under pytest (collects them only when dry), in its own process group
    ended at the section's time left; ok when none failed or errored."""
    import importlib.util

    present = [t for t in CUDA_TESTS if (ROOT / t.split("::")[0]).is_file()]
    missing = sorted(set(CUDA_TESTS) - set(present))
    if importlib.util.find_spec("pytest") is None:
        return {"ok": True, "skipped": "pytest is not installed in this Python (make gpu-check-wheels adds it)",
                "files": list(CUDA_TESTS)}
    if not present:
        return {"ok": True, "skipped": "the CUDA test files are not in this tree", "files": list(CUDA_TESTS)}
    junit = ctx.workdir / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *present]
    if ctx.dry_run:
        cmd.append("--collect-only")
    limit = max(10.0, ctx.remaining_s() - 5)
    code, tail = _run_group(cmd, limit)
    result: dict[str, Any] = {"command": " ".join(cmd[2:]), "exit_status": code, "missing": missing,
                              "output_tail": tail[-3000:]}
    if code is None:
        return {**result, "ok": False, "error": f"pytest did not finish within {limit:.0f} s; its process group "
                                                "was ended"}
    if ctx.dry_run:
        collected = sum(1 for line in tail.splitlines() if "::" in line)
        return {**result, "ok": code == 0 and collected > 0, "collected": collected}
    counts, skips, failures = _junit_summary(junit)
    return {**result, "ok": code in (0, 5) and not counts["failed"] and not counts["errors"], "counts": counts,
            "skip_reasons": skips, "failures": failures}


def _run_group(cmd: list[str], limit: float) -> tuple[int | None, str]:
    """Runs `cmd` in a new session; ends the whole group (its rank processes too) at `limit` or
    when this process is ended. (exit status or None when ended, combined output)."""
    import subprocess

    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(ROOT), str(ROOT / "protos"), os.environ.get("PYTHONPATH", "")])})
        code: int | None = None
        try:
            code = proc.wait(limit)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also when this section is ended (SystemExit): the group goes with it
            if code is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        out.seek(0)
        return code, out.read()


def _junit_summary(path: Path) -> tuple[dict[str, int], list[str], list[str]]:
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips: list[str] = []
    failures: list[str] = []
    if not path.is_file():
        return counts, skips, ["pytest wrote no report"]
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if (node := case.find("skipped")) is not None:
            counts["skipped"] += 1
            skips.append(f"{name}: {node.get('message', '')}")
        elif (node := case.find("failure")) is not None or (node := case.find("error")) is not None:
            counts["failed" if node.tag == "failure" else "errors"] += 1
            failures.append(f"{name}: {(node.get('message') or '')[:300]}")
        else:
            counts["passed"] += 1
    return counts, skips, failures


# -- (3) KV transfer bandwidth --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class KVShape:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * 2 * self.kv_heads * self.block_size * self.head_dim * (4 if self.dtype == "float32" else 2)


def check_transfer(ctx: CheckContext) -> dict[str, Any]:
    sizes = [16, 64] if ctx.dry_run else [int(s) for s in ctx.args.sizes.split(",")]
    # A Llama-3-8B-like block (32 layers, 8 KV heads, head_dim 128, 16 tokens, bf16: 2 MiB); tiny when dry.
    shape = (KVShape(2, 2, 8, 4, "float32", max(sizes)) if ctx.dry_run
             else KVShape(32, 8, 128, 16, "bfloat16", max(sizes)))
    iters = 2 if ctx.dry_run else ctx.args.iters
    methods = ["pdserve", "pdserve-host-staging", "copy", "nixl"]
    if ctx.dry_run:  # the host bounce is the same pair with one flag (tests/integration/ucx cover it)
        methods.remove("pdserve-host-staging")
    timings: dict[str, dict[int, float | None]] = {}
    notes: dict[str, str] = {}
    for method in methods:
        try:
            timings[method] = _time_method(method, ctx.device, shape, sizes, iters)
        except _Unavailable as e:
            timings[method] = dict.fromkeys(sizes)
            notes[method] = str(e)
    rows: list[dict[str, Any]] = [{"num_blocks": n, "num_bytes": n * shape.block_nbytes,
             "gbps": {m: (float(f"{n * shape.block_nbytes / t / 1e9:.4g}") if t else None) for m, t in
                      ((m, timings[m][n]) for m in methods)}} for n in sizes]
    for row in rows:
        g = row["gbps"]
        row["pdserve_vs_copy"] = float(f"{g['pdserve'] / g['copy']:.3g}") if g["pdserve"] and g["copy"] else None
        row["pdserve_vs_nixl"] = float(f"{g['pdserve'] / g['nixl']:.3g}") if g["pdserve"] and g["nixl"] else None
    ok = all(timings["pdserve"][n] is not None for n in sizes)
    return {"ok": ok, "block_nbytes": shape.block_nbytes, "shape": _shape_dict(shape),
            "iters": iters, "methods": {
                "pdserve": "UCX connector, decode pulls the prefill rank's GPU blocks (cuda_ipc), byte-checked",
                "pdserve-host-staging": "the same with --kv-staging host (labelled: bounces through pinned host memory; "
                                        "the writer's copy-out at pin time is added to each pull)",
                "copy": "one process: device-to-device copy of the same bytes (host memcpy when dry)",
                "nixl": "NIXL READ of the same bytes between two processes (VRAM)"}, "unavailable": notes,
            "rows": rows}


def _shape_dict(shape: KVShape) -> dict[str, Any]:
    return {"num_layers": shape.num_layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "block_size": shape.block_size, "dtype": shape.dtype}


class _Unavailable(RuntimeError):
    pass


def _time_method(method: str, device: str, shape: KVShape, sizes: list[int], iters: int) -> dict[int, float | None]:
    if method == "copy":
        return _time_copy(device, shape, sizes, iters)
    if method == "nixl":
        try:
            _nixl_version()
        except ImportError as e:
            raise _Unavailable(str(e)) from None
        if device != "cuda":
            raise _Unavailable("NIXL VRAM reads need a GPU")
    pair = _Pair(method, device, shape)
    try:
        return {n: pair.median_pull(n, iters) for n in sizes}
    finally:
        pair.close()


def _time_copy(device: str, shape: KVShape, sizes: list[int], iters: int) -> dict[int, float | None]:
    import torch

    src = _kv_tensor(device, shape, seed=1)
    dst = torch.zeros_like(src)
    out: dict[int, float | None] = {}
    for n in sizes:
        samples = []
        for i in range(iters + 1):
            _sync(device)
            t0 = time.perf_counter()
            dst[:n].copy_(src[:n])
            _sync(device)
            if i:
                samples.append(time.perf_counter() - t0)
        out[n] = statistics.median(samples)
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _kv_tensor(device: str, shape: KVShape, seed: int = 0) -> Any:
    import torch

    dtype = getattr(torch, shape.dtype)
    kv = torch.zeros(shape.num_blocks, shape.kv_heads, shape.num_layers, 2, shape.block_size, shape.head_dim,
                     dtype=dtype, device=device)
    if seed:
        kv.uniform_(generator=torch.Generator(device=device).manual_seed(seed))
    return kv


class _Pair:
    """A writer and a reader process of one method; the reader times pulls."""

    def __init__(self, method: str, device: str, shape: KVShape) -> None:
        spawn = mp.get_context("spawn")
        self.procs: list[tuple[Connection, Any]] = []
        for role in ("writer", "reader"):
            conn, child = spawn.Pipe()
            proc = spawn.Process(target=_transfer_main, args=(child, role, method, device, shape), daemon=True)
            proc.start()
            self.procs.append((conn, proc))
        (w, _), (r, _) = self.procs
        writer_metadata = _answer(w)
        _answer(r)  # the reader's own metadata (nobody reads from the reader)
        r.send(writer_metadata)
        _answer(r)  # connected

    def median_pull(self, n: int, iters: int) -> float:
        (w, _), (r, _) = self.procs
        samples = []
        for i in range(iters + 1):
            tag = f"x{n}-{i}"
            w.send(("prepare", tag, n))
            _answer(w)
            r.send(("pull", tag, n))
            seconds = _answer(r)
            w.send(("finish", tag, n))
            seconds += _answer(w)  # the writer's copy-out with host staging (0 otherwise)
            if i:
                samples.append(seconds)
        r.send(("check", "", n))
        digest = _answer(r)
        w.send(("check", "", n))
        if digest != _answer(w):
            raise RuntimeError(f"pulled blocks differ from the writer's ({n} blocks)")
        return statistics.median(samples)

    def close(self) -> None:
        for conn, proc in self.procs:
            try:
                conn.send(("stop", "", 0))
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _answer(conn: Connection, timeout: float = 300.0) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError("transfer process did not answer")
    status, value = conn.recv()
    if status == "unavailable":
        raise _Unavailable(value)
    if status != "ok":
        raise RuntimeError(value)
    return value


def _transfer_main(conn: Connection, role: str, method: str, device: str, shape: KVShape) -> None:
    import os

    sys.stdout.flush()
    os.dup2(2, 1)  # UCX and NIXL print; stdout belongs to the parent's summary
    try:
        endpoint = (_NixlEnd if method == "nixl" else _PdserveEnd)(role, method, device, shape)
    except _Unavailable as e:
        conn.send(("unavailable", str(e)))
        return
    except Exception as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", endpoint.metadata()))
    if role == "reader":
        endpoint.connect(conn.recv())
        conn.send(("ok", None))
    while True:
        command, tag, n = conn.recv()
        if command == "stop":
            break
        try:
            conn.send(("ok", getattr(endpoint, command)(tag, n)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))
    endpoint.close()


def _digest(kv: Any, n: int) -> str:
    import hashlib

    import torch

    return hashlib.blake2b(kv[:n].contiguous().view(torch.uint8).cpu().numpy().tobytes(), digest_size=16).hexdigest()


class _PdserveEnd:
    """One side of pdserve's UCX connector: the writer pins blocks [0, n), the reader pulls them."""

    def __init__(self, role: str, method: str, device: str, shape: KVShape) -> None:
        from connectors.ucx.config import UcxConnectorConfig
        from connectors.ucx.worker import UcxWorkerConnector

        self.role, self.shape = role, shape
        self.kv = _kv_tensor(device, shape, seed=1 if role == "writer" else 0)
        staging = "host" if method == "pdserve-host-staging" else "none"
        self.c = UcxWorkerConnector(engine_id=role, epoch=1, tp_rank=0, tp_size=1, num_kv_heads=shape.kv_heads,
                                    compatibility_hash="gpu-check", kv_cache=self.kv,
                                    config=UcxConnectorConfig(kv_staging=staging, transfer_timeout_s=60.0))

    def metadata(self) -> bytes:
        return self.c.get_handshake_metadata()

    def connect(self, writer_metadata: bytes) -> None:
        self.c.add_peer(writer_metadata)

    def prepare(self, tag: str, n: int) -> None:
        self.c.expect_send(tag, list(range(n)))

    def pull(self, tag: str, n: int) -> float:
        from connectors.ucx.handshake import KVTransferDescriptor

        s = self.shape
        d = KVTransferDescriptor("writer", 1, tag, tuple(range(n)), n * s.block_size, 1, s.block_size, s.kv_heads)
        t0 = time.perf_counter()
        self.c.start_pull(tag, d, list(range(n)))
        self._wait(lambda r: tag in r.finished_recving, tag)
        return time.perf_counter() - t0

    def finish(self, tag: str, n: int) -> float:
        """Waits until the writer released the blocks; returns its host-staging seconds (the
        copy-out at pin time, outside the reader's clock)."""
        self._wait(lambda r: tag in r.finished_sending, tag)
        stats = self.c.get_kv_connector_stats()
        return float(sum(stats.data.get("host_staging_duration", []))) if stats is not None else 0.0

    def _wait(self, done: Callable[[Any], bool], tag: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = self.c.get_transfer_results()
            if r.failed_recving:
                raise RuntimeError(f"pull of {tag} failed: {self.c.take_failure_reasons()}")
            if done(r):
                return
            self.c.wait_for_results(0.05)
        raise TimeoutError(f"{tag} not done in 120 s")

    def check(self, tag: str, n: int) -> str:
        return _digest(self.kv, n)

    def close(self) -> None:
        self.c.shutdown()


def _nixl_api() -> Any:
    import importlib

    for module in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(module)
        except ImportError:
            continue
    raise _Unavailable("nixl not installed")


class _NixlEnd:
    """One side of NIXL's READ of VRAM (the writer registers, the reader reads blocks [0, n))."""

    def __init__(self, role: str, method: str, device: str, shape: KVShape) -> None:
        api = _nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        self.shape = shape
        self.kv = _kv_tensor(device, shape, seed=1 if role == "writer" else 0)
        self.agent = nixl_agent(f"gpu-check-{role}", nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self.agent.register_memory(self.kv)
        self.remote: tuple[str, int] | None = None

    def metadata(self) -> tuple[bytes, int]:
        return self.agent.get_agent_metadata(), self.kv.data_ptr()

    def connect(self, writer: tuple[bytes, int]) -> None:
        self.remote = (self.agent.add_remote_agent(writer[0]), writer[1])

    def prepare(self, tag: str, n: int) -> None:
        """Nothing to pin: NIXL reads registered memory."""

    def finish(self, tag: str, n: int) -> float:
        """Nothing to release."""
        return 0.0

    def pull(self, tag: str, n: int) -> float:
        assert self.remote is not None
        name, base = self.remote
        size = n * self.shape.block_nbytes
        t0 = time.perf_counter()
        local = self.agent.get_xfer_descs([(self.kv.data_ptr(), size, self.kv.device.index or 0)], "VRAM")
        remote = self.agent.get_xfer_descs([(base, size, 0)], "VRAM")
        handle = self.agent.initialize_xfer("READ", local, remote, name, tag.encode())
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL transfer failed to post")
        while (state := self.agent.check_xfer_state(handle)) != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
        elapsed = time.perf_counter() - t0
        self.agent.release_xfer_handle(handle)
        return elapsed

    def check(self, tag: str, n: int) -> str:
        return _digest(self.kv, n)

    def close(self) -> None:
        """The agent goes with the process."""
