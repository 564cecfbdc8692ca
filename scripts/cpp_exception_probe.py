"""Do C++ exceptions in a torch extension work in this process setup? One case per subprocess.

    python scripts/cpp_exception_probe.py [CASE ...]

Stop 28 saw any C++ exception unwinding through an extension built on the GPU machines kill the
process (SIGSEGV), and kept ``csrc/launch_plan.cpp`` exception-free because of it. Each CASE is a
comma list of what the process does before it builds and calls a small extension (``torch``:
nothing more; ``triton``: import Triton; ``cuda``: a CUDA call; ``turbo``: import turbo_moe;
``run``: three GroupedLinearFP8 fwd+bwd with host plans; ``static``: link libgcc/libstdc++
statically). The extension throws and catches a ``std::runtime_error`` and raises a
``TORCH_CHECK`` failure to Python. Prints each case's exit code, what it printed, and which
libgcc/libstdc++ the process loaded (docs/results/h100_host_plans.md, "What did not work").
"""
import os, subprocess, sys, textwrap

SRC = r'''
#include <torch/extension.h>
#include <stdexcept>
int64_t throw_catch() { try { throw std::runtime_error("x"); } catch (const std::exception&) { return 1; } return 0; }
int64_t torch_check(int64_t v) { TORCH_CHECK(v > 0, "v must be positive"); return v; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("throw_catch", &throw_catch); m.def("torch_check", &torch_check); }
'''

CASE = textwrap.dedent('''
import os, sys, torch
pre = sys.argv[1]
if "triton" in pre:
    import triton, triton.language as tl
if "turbo" in pre:
    import turbo_moe
if "cuda" in pre:
    torch.ones(1, device="cuda")
if "run" in pre:  # a GroupedLinearFP8 fwd+bwd, 3 times: the host-plan extension built, recorded and replayed
    import turbo_moe
    from turbo_moe import host_plan
    layer = turbo_moe.GroupedLinearFP8(4, 256, 256).cuda()
    lens = torch.tensor([64, 0, 100, 92], device="cuda")
    for _ in range(3):
        x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        layer(x, lens).sum().backward()
    torch.cuda.synchronize()
    print("host plans:", host_plan.status(), flush=True)
from torch.utils.cpp_extension import load_inline
flags = ["-O2"] + (["-static-libgcc", "-static-libstdc++"] if "static" in pre else [])
ldflags = (["-static-libgcc", "-static-libstdc++"] if "static" in pre else [])
mod = load_inline("exc_probe_" + pre.replace(",", "_"), cpp_sources=SRC, extra_cflags=flags, extra_ldflags=ldflags,
                  build_directory=None, verbose=False)
print("throw_catch", mod.throw_catch(), flush=True)
try:
    mod.torch_check(-1)
except RuntimeError as e:
    print("torch_check raised RuntimeError:", str(e).splitlines()[0], flush=True)
maps = open("/proc/self/maps").read()
libs = sorted({l.split()[-1] for l in maps.splitlines() if ("libgcc" in l or "libstdc++" in l or "unwind" in l)})
print("loaded:", libs)
''')

os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/cpp_exception_probe")
print(subprocess.run(["g++", "--version"], capture_output=True, text=True).stdout.splitlines()[0])
for pre in sys.argv[1:] or ["torch", "triton", "cuda", "triton,cuda", "turbo,cuda", "static,triton,cuda"]:
    r = subprocess.run([sys.executable, "-c", "SRC = " + repr(SRC) + "\n" + CASE, pre], capture_output=True, text=True, timeout=300)
    print(f"== {pre}: rc {r.returncode}")
    print("  " + (r.stdout.strip() or "(no stdout)").replace("\n", "\n  "))
    if r.returncode:
        print("  stderr tail: " + " | ".join(r.stderr.strip().splitlines()[-4:]))
