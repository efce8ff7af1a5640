#!/usr/bin/env python3
"""Compile kvtier_copy.cu to PTX with libnvrtc (ctypes), the way src/cuda/device.rs does at run time.

usage: nvrtc_compile.py LIBNVRTC ARCH OUT.ptx   (ARCH like sm_90)
Exits non-zero with NVRTC's log on a compile error.
"""
import ctypes, os, sys

lib_path, arch, out = sys.argv[1], sys.argv[2], sys.argv[3]
here = os.path.dirname(os.path.abspath(__file__))
nvrtc = ctypes.CDLL(lib_path)
src = open(os.path.join(here, "kvtier_copy.cu"), "rb").read()
headers = ["kvtier_copy.cuh", "kvtier_pattern.cuh"]
hsrc = [open(os.path.join(here, h), "rb").read() for h in headers]

def check(res, what):
    if res != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise SystemExit(f"{what} failed: {nvrtc.nvrtcGetErrorString(res).decode()}")

prog = ctypes.c_void_p()
n = len(headers)
check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"kvtier_copy.cu", n,
                               (ctypes.c_char_p * n)(*hsrc), (ctypes.c_char_p * n)(*[h.encode() for h in headers])),
      "nvrtcCreateProgram")
# The same options as the Rust side (src/cuda/device.rs), but virtual arch so ptxas can check sm_XY.
opts = [f"--gpu-architecture=compute_{arch[3:]}".encode(), b"-std=c++17", b"-default-device", b"-lineinfo"]
res = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode(), file=sys.stderr)
check(res, "nvrtcCompileProgram")
nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
ptx = ctypes.create_string_buffer(size.value)
check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
open(out, "wb").write(ptx.value)
print(f"  nvrtc {arch}: {len(ptx.value)} B of PTX -> {out}")
