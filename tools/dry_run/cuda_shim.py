"""A CUDA device that exists only on paper, for fake tensors in a CPU-only torch.

A CPU-only torch can describe tensors on ``cuda:0`` under ``FakeTensorMode``, but its
C++ side has no CUDA device guard and no CUDA hooks: indexing such a tensor, or
running autograd through it, aborts with "PyTorch is not linked with support for cuda
devices" / "Cannot access accelerator device". This module compiles (once, cached) and
loads a tiny shared library that registers a no-op CUDA device guard (one device, one
stream, events that are always complete) and CUDA hooks that report one device and make
generators on it (``torch.Generator(device="cuda")``: a seed and an offset). No
kernel ever runs on it: every tensor on it must be a fake tensor.

It imports no torch: ``load_cuda_shim()`` must run before ``import torch``, because torch
picks its CUDA hooks once, while it is imported. With a CUDA build of torch (a GPU
machine) nothing is compiled or loaded.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import subprocess
import sys
from typing import Optional

SHIM_SOURCE = r"""
#include <ATen/EmptyTensor.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cstring>

namespace {
using c10::Device;
using c10::DeviceType;
using c10::Stream;

// One CUDA device (index 0), one stream, events that are always complete.
struct PaperCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override { return Stream(Stream::DEFAULT, s.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
};
C10_REGISTER_GUARD_IMPL(CUDA, PaperCudaGuard);
}  // namespace

namespace at {
namespace {
// A generator on cuda:0 holding a seed and an offset (its state: 16 bytes, as CUDA's Philox
// generator has), so code that seeds a generator of its operand's device runs; no draw reads it.
struct PaperCudaGenerator final : public c10::GeneratorImpl {
  explicit PaperCudaGenerator(c10::DeviceIndex index = 0)
      : c10::GeneratorImpl(c10::Device(c10::DeviceType::CUDA, index < 0 ? 0 : index),
                           c10::DispatchKeySet(c10::DispatchKey::CUDA)) {}
  void set_current_seed(uint64_t seed) override { seed_ = seed; offset_ = 0; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override { seed_ = c10::detail::getNonDeterministicRandom(true); return seed_; }
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.numel() == 16 && state.dtype().itemsize() == 1, "a CUDA generator state is 16 bytes");
    std::memcpy(&seed_, state.data(), 8);
    std::memcpy(&offset_, static_cast<const char*>(state.data()) + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto state = at::detail::empty_cpu({16}, c10::ScalarType::Byte, std::nullopt, std::nullopt, std::nullopt,
                                       std::nullopt);
    std::memcpy(state.data_ptr(), &seed_, 8);
    std::memcpy(static_cast<char*>(state.data_ptr()) + 8, &offset_, 8);
    return state.getIntrusivePtr();
  }
  PaperCudaGenerator* clone_impl() const override {
    auto copy = new PaperCudaGenerator(device_.index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }
  uint64_t seed_ = 67280421310721ULL;
  uint64_t offset_ = 0;
};

struct PaperCudaHooks final : public CUDAHooksInterface {
  explicit PaperCudaHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void*) const override { return false; }
  void init() const override {}
  Generator getNewGenerator(c10::DeviceIndex index) const override {
    return make_generator<PaperCudaGenerator>(index);
  }
};
}  // namespace
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, PaperCudaHooks);
}  // namespace at

extern "C" int megatron_paper_cuda_loaded() { return 1; }
"""

_LOADED: Optional[str] = None  # "shim" or "native" once decided


def torch_dir() -> str:
    """The installed torch package directory, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the GPU dry run needs torch installed")
    return list(spec.submodule_search_locations)[0]


def torch_has_cuda(root: Optional[str] = None) -> bool:
    """Whether the installed torch is a CUDA build (its CUDA libraries are present)."""
    lib = os.path.join(root or torch_dir(), "lib")
    return bool(glob.glob(os.path.join(lib, "libtorch_cuda*")) or glob.glob(os.path.join(lib, "libc10_cuda*")))


def _cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "megatron-dry-run")
    return os.environ.get("MEGATRON_DRY_RUN_CACHE", default)


def _torch_stamp(root: str) -> str:
    with open(os.path.join(root, "version.py"), "rb") as f:
        return hashlib.sha1(f.read() + SHIM_SOURCE.encode()).hexdigest()[:16]


def build_cuda_shim(root: Optional[str] = None) -> str:
    """Compile the shim for the installed torch (cached by torch version); returns the library path."""
    root = root or torch_dir()
    out_dir = os.path.join(_cache_dir(), _torch_stamp(root))
    target = os.path.join(out_dir, "libpaper_cuda.so")
    if os.path.isfile(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    source = os.path.join(out_dir, f"paper_cuda.{os.getpid()}.cpp")
    with open(source, "w") as f:
        f.write(SHIM_SOURCE)
    tmp = f"{target}.{os.getpid()}.tmp"
    lib = os.path.join(root, "lib")
    cmd = [
        os.environ.get("CXX", "g++"),
        "-O1",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-I" + os.path.join(root, "include"),
        source,
        "-L" + lib,
        "-lc10",
        "-ltorch_cpu",
        "-Wl,-rpath," + lib,
        "-o",
        tmp,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise RuntimeError(
            f"the fake-CUDA dry run on a CPU-only torch compiles a small C++ shim and needs a C++ "
            f"compiler: {cmd[0]} not found (set CXX)"
        ) from None
    finally:
        os.remove(source)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the CUDA shim failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    return target


def load_cuda_shim() -> str:
    """Make ``cuda:0`` usable by fake tensors; returns "shim" (loaded) or "native" (CUDA build).

    Raises:
        RuntimeError: torch was imported before the shim could be loaded, or the build failed.
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    root = torch_dir()
    if torch_has_cuda(root):
        _LOADED = "native"
        return _LOADED
    if "torch" in sys.modules:
        raise RuntimeError(
            "the CUDA shim must be loaded before torch is imported (torch picks its CUDA hooks at "
            "import): call load_cuda_shim() first, e.g. run tools/gpu_dry_run.py as a script"
        )
    ctypes.CDLL(build_cuda_shim(root), mode=ctypes.RTLD_GLOBAL)
    _LOADED = "shim"
    return _LOADED


def cuda_shim_state() -> Optional[str]:
    """ "shim", "native", or None when ``load_cuda_shim`` has not run in this process."""
    return _LOADED
