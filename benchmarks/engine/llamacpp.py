"""The llama.cpp side of benchmarks/engine/bench.py (`--side llamacpp`): one stream on the same GGUF
file with the same threads, through llama-cpp-python.

When llama-cpp-python is absent, `ensure_llama_cpp()` builds it from its sdist (a few minutes on 2
cores) with flags chosen from this CPU: GGML_NATIVE=ON segfaulted at load on an AMX Xeon, so the
ISA is named explicitly: AVX-512 (+VNNI where present, AMX off) or AVX2/FMA/F16C.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.bench_common import SEED_ONE_STREAM, log, machine_info, random_prompts, section

LLAMA_CPP_VERSION = "0.3.36"


def cmake_args() -> str:
    from pdserve.engine.cpu import cpu_features

    cpu = cpu_features()
    args = [
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
    ]
    if cpu.has("avx512f"):
        args += [
            "-DGGML_AVX512=ON",
            f"-DGGML_AVX512_VNNI={'ON' if cpu.has('avx512_vnni') else 'OFF'}",
            f"-DGGML_AVX512_BF16={'ON' if cpu.has('avx512_bf16') else 'OFF'}",
            "-DGGML_AMX_INT8=OFF",
        ]
    return " ".join(args)


def ensure_llama_cpp() -> str:
    """Imports llama_cpp, building it first if needed; returns how it was obtained."""
    try:
        import llama_cpp  # noqa: F401

        return "installed"
    except ImportError:
        pass
    flags = cmake_args()
    log(
        f"llama-cpp-python is absent: building {LLAMA_CPP_VERSION} with CMAKE_ARGS='{flags}' "
        "(a few minutes)"
    )
    env = dict(os.environ, CMAKE_ARGS=flags, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-cache-dir",
            f"llama-cpp-python=={LLAMA_CPP_VERSION}",
        ],
        env=env,
        check=True,
    )
    return f"built here with CMAKE_ARGS='{flags}'"


def run_llamacpp(args) -> dict:
    how = ensure_llama_cpp()
    import llama_cpp

    from pdserve.engine.loader.resolve import smollm2_gguf_path

    if args.model != "smollm2" and not args.model.endswith(".gguf"):
        return {
            "side": "llamacpp",
            "error": "llama.cpp needs a GGUF model (smollm2 or a .gguf path)",
        }
    path = str(smollm2_gguf_path() if args.model == "smollm2" else args.model)
    res: dict = {
        "side": "llamacpp",
        "machine": machine_info(args.threads),
        "how": how,
        "version": llama_cpp.__version__,
        "gguf": os.path.basename(path),
    }
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=path,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=max(512, args.prompt_len + args.new_tokens + 8),
        n_batch=512,
        verbose=False,
    )
    res["load_s"] = time.perf_counter() - t0
    M = args.new_tokens

    def one_stream():
        prompt = random_prompts(SEED_ONE_STREAM, 1, args.prompt_len)[0]
        runs = []
        for _ in range(2):  # the first run warms up
            times = []
            for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                times.append(time.perf_counter())
                if len(times) == M:
                    break
            runs.append((M - 1) / (times[-1] - times[0]))
        return {"decode_tok_s": runs[-1], "runs_tok_s": runs}

    section(res, "one_stream", one_stream)
    return res
