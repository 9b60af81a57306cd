"""What the Pallas (Triton lowering) kernels compile to on the GPU: a census of the PTX instructions that decide a
latency-bound kernel's step time (tensor-core form: Hopper's asynchronous warpgroup MMA `wgmma` or the synchronous
per-warp `mma.sync`; shared-memory round trips; barriers; asynchronous copies), and ptxas's register, spill and
shared-memory report per kernel where a ptxas binary is found.

XLA dumps each compiled module's PTX (`--xla_dump_to`), which holds the Triton kernels of the Pallas calls beside
XLA's own; this script compiles the named kernels once at small shapes (the instruction mix does not depend on
the sequence length) and reads the dump.

    python bench/kernel_isa.py --out DIR [--configs "default,c128"] [--no-fold]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DUMP = tempfile.mkdtemp(prefix="kernel-isa-")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_gpu_dump_llvmir=true"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

PATTERNS = {  # instruction class -> PTX regex (counted per kernel entry, static counts, not executions)
    "wgmma": r"\bwgmma\.mma_async",
    "wgmma_wait": r"\bwgmma\.wait_group",
    "mma_sync": r"\bmma\.sync",
    "ldmatrix": r"\bldmatrix",
    "stmatrix": r"\bstmatrix",
    "ld_shared": r"\bld\.shared",
    "st_shared": r"\bst\.shared",
    "bar_sync": r"\b(bar\.sync|barrier\.sync|bar\.arrive)",
    "cp_async": r"\bcp\.async\.(ca|cg)",
    "tma": r"\bcp\.async\.bulk",
    "mbarrier": r"\bmbarrier",
    "ld_global": r"\bld\.global",
    "st_global": r"\bst\.global",
    "ex2": r"\bex2\.approx",
}


def census(ptx_text: str, name_filter: str) -> dict:
    """Per `.entry` whose name matches `name_filter`: counts of each PATTERNS class."""
    out = {}
    parts = re.split(r"(?m)^\s*(?:\.(?:visible\s+)?entry\s+|define\s+[^@]*@)", ptx_text)
    for part in parts[1:]:
        name = part.split("(", 1)[0].strip().strip('"')
        if not re.search(name_filter, name):
            continue
        out[name] = {k: len(re.findall(p, part)) for k, p in PATTERNS.items()}
    return out


def _kernel_texts() -> list[str]:
    """Dumped files that hold kernel code: PTX, or LLVM IR (Triton writes its MMA instructions as inline PTX)."""
    return [f for f in glob.glob(os.path.join(DUMP, "**", "*"), recursive=True)
            if f.endswith((".ptx", ".ll")) and os.path.isfile(f)]


def _ptxas() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    for root in sys.path:
        hits = glob.glob(os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas"))
        if hits:
            return hits[0]
    return None


def ptxas_report(path: str, name_filter: str) -> dict:
    """ptxas -v on one dumped PTX file: registers, spill bytes and shared memory per matching kernel."""
    exe = _ptxas()
    if exe is None:
        return {"error": "no ptxas binary found"}
    text = open(path).read()
    target = re.search(r"(?m)^\.target\s+(\S+)", text)
    arch = target.group(1).rstrip(",") if target else "sm_90a"
    res = subprocess.run([exe, f"-arch={arch}", "-v", "-o", os.devnull, path], capture_output=True, text=True,
                         timeout=300)
    report, current = {}, None
    for line in res.stderr.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?", line)
        if m:
            current = m.group(1)
            continue
        if current and re.search(name_filter, current):
            entry = report.setdefault(current, {})
            for key, pat in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                             ("spill_loads", r"(\d+) bytes spill loads"), ("smem", r"(\d+) bytes smem")):
                m = re.search(pat, line)
                if m:
                    entry[key] = int(m.group(1))
    if res.returncode and not report:
        report["error"] = res.stderr[-600:]
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default="default,tile c128 lw8 ss1,doubling c128 sub64 lw4 ss1")
    ap.add_argument("--no-fold", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from hypic_jax import linear_attn as la
    from hypic_jax.pallas import compose, gdn
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernels import step_variants

    heads, key_heads, dim, length = 32, 16, 128, 1024
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = la.l2_normalize(jax.random.normal(keys[0], (length, key_heads, dim))).astype(jnp.bfloat16)
    k = la.l2_normalize(jax.random.normal(keys[1], (length, key_heads, dim))).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (length, heads, dim), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (length, heads)) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (length, heads)))
    configs = {"default": gdn.GDNConfig(), **{n: cfg for n, (cfg, emit, per_key) in step_variants().items()
                                              if per_key is False and not emit}}
    results = {}
    for name in [x.strip() for x in args.configs.split(",") if x.strip()]:
        before = set(_kernel_texts())
        fn = jax.jit(lambda q, k, v, g, b, cfg=configs[name]: gdn.gdn_forward(q, k, v, g=g, beta=b, scale=dim**-0.5,
                                                                              config=cfg))
        try:
            jax.block_until_ready(fn(q, k, v, g, beta))
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, results[name], flush=True)
            continue
        new = sorted(set(_kernel_texts()) - before)
        results[name] = {"ptx_files": [os.path.basename(p) for p in new], "census": {}, "ptxas": {}}
        for path in new:
            results[name]["census"].update(census(open(path).read(), "gdn"))
            if path.endswith(".ptx"):
                results[name]["ptxas"].update(ptxas_report(path, "gdn"))
        print(name, json.dumps(results[name]["census"]), json.dumps(results[name]["ptxas"]), flush=True)
    if not args.no_fold:
        before = set(_kernel_texts())
        t = jax.random.normal(keys[0], (4, 8, dim, dim)) * 0.05
        s = jax.random.normal(keys[1], (4, 8, dim, dim))
        for with_transfer in (False, True):
            jax.block_until_ready(compose.fold_pallas(t, s, with_transfer=with_transfer,
                                                      config=compose.FINAL_STATE_CONFIG))
        new = sorted(set(_kernel_texts()) - before)
        results["compose fold"] = {"census": {}, "ptxas": {}}
        for path in new:
            results["compose fold"]["census"].update(census(open(path).read(), "compose|fold"))
            if path.endswith(".ptx"):
                results["compose fold"]["ptxas"].update(ptxas_report(path, "compose|fold"))
        print("compose fold", json.dumps(results["compose fold"]), flush=True)
    if not any(_kernel_texts()):
        files = sorted(glob.glob(os.path.join(DUMP, "**", "*"), recursive=True))
        kinds = sorted({os.path.basename(f).split(".")[-1] for f in files})
        print("no PTX or LLVM IR in the dump; file kinds:", kinds,
              [os.path.relpath(f, DUMP) for f in files if "gdn" in f or "triton" in f or "pallas" in f][:30],
              flush=True)
    with open(os.path.join(args.out, "kernel_isa.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
