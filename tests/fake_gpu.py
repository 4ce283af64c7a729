"""A GPU on the CPU for the dry-run tests: the engine runs with device="cuda" on fake tensors
(torch's FakeTensorMode: shapes, dtypes and devices, no data, nothing allocated), so a tensor
left on the host beside one on the device, or a dtype only bf16 exposes, raises here as it would
on a GPU; and every read of device data by the host is counted.

Three parts:
- a CUDA device guard compiled from fake_cuda_guard.cpp (once, about two seconds; g++ and torch's
  headers), which a CPU build lacks and which indexing or copying a fake CUDA tensor needs;
- FakeGPU, a dispatch mode above FakeTensorMode: operations that touch no device tensor run for
  real on the CPU (the host's own work, such as grammar masks and numpy-built batches, keeps its
  values), the others go to FakeTensorMode;
- the host reads: a fake tensor has no data, so FakeTensorMode raises where the host would wait
  for the device (aten._local_scalar_dense behind .item(), bool(t), .tolist() of a scalar; a
  device-to-host copy behind .cpu() / .tolist(); nonzero, whose output shape is the data).
  FakeGPU records each one (the op and the engine line that asked) and answers with plausible
  values instead: every number reads back as `token` (so sampled ids are valid tokens, also when
  they come back packed in a float buffer with their log-probabilities), booleans as False, and
  nonzero as no hits.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

from engine.config import ModelConfig
from engine.model import CausalLM

ROOT = Path(__file__).resolve().parent.parent
_GUARD_SOURCE = Path(__file__).with_name("fake_cuda_guard.cpp")
_guard_loaded = False


def load_fake_cuda_guard() -> None:
    """Compile (once per torch version and source) and load the CUDA device guard."""
    global _guard_loaded
    if _guard_loaded or torch.cuda.is_available():
        return
    torch_dir = Path(torch.__file__).parent
    source = _GUARD_SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    key = f"{torch.__version__}-{sys.version_info.major}{sys.version_info.minor}-{digest}"
    library = Path(tempfile.gettempdir()) / f"genq-fake-cuda-guard-{key}.so"
    if not library.exists():
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{torch_dir / 'include'}",
                        str(_GUARD_SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}",
                        "-o", str(partial)], check=True, capture_output=True)
        partial.replace(library)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _guard_loaded = True


@dataclass(frozen=True)
class HostRead:
    """One read of device data by the host: the op, and the innermost engine/kernels function asking
    ("engine/step_batch.py run": no line number, so edits elsewhere in the file keep it)."""

    op: str
    where: str


_DEVICE_TO_HOST = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}
_SCALAR_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
                 torch.ops.aten.is_nonzero.default}


def _on_device(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in ("engine", "kernels"):
            return f"{path.relative_to(ROOT)} {frame.name}"
    return "outside the engine"


def _listing() -> FrameType | None:
    """The outermost FakeTensor.tolist() frame on the stack (it reads a list element by element)."""
    frame, found = sys._getframe(), None
    while frame is not None:
        if frame.f_code is FakeTensor.tolist.__code__:
            found = frame
        frame = frame.f_back
    return found


class FakeGPU(FakeTensorMode):
    """See the module docstring. reads: the host reads since the last reset(). A FakeTensorMode
    itself rather than a mode stacked above one: under inference_mode a stacked mode does not see
    the fake tensors' scalar reads."""

    def __init__(self, token: int = 0) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.token = token
        self.reads: list[HostRead] = []
        self._listing: FrameType | None = None  # the FakeTensor.tolist() call being read, held so no other has its id

    def reset(self) -> list[HostRead]:
        reads, self.reads = self.reads, []
        return reads

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        fake = any(isinstance(a, FakeTensor) for a in flat)
        if not fake and not any(isinstance(a, torch.device) and a.type == "cuda" for a in flat):
            return func(*args, **kwargs)  # the host's own work: real values (this mode is off in here)
        if func in _SCALAR_READS and any(_on_device(a) for a in flat):
            listing = _listing()
            if listing is None or listing is not self._listing:  # a tolist() is one read, not one per element
                self.reads.append(HostRead("tolist" if listing is not None else func.overloadpacket.__name__,
                                           _caller()))
            self._listing = listing
            return self._scalar(args[0].dtype)
        if func is torch.ops.aten.nonzero.default and _on_device(args[0]):
            self.reads.append(HostRead("nonzero", _caller()))
            return torch.empty(0, args[0].dim(), dtype=torch.long, device=args[0].device)
        if func in _DEVICE_TO_HOST:
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device", source.device)
            if _on_device(source) and torch.device(target).type == "cpu":
                self.reads.append(HostRead("device-to-host copy", _caller()))
                dtype = kwargs.get("dtype") or source.dtype
                values = torch.full(source.shape, self._scalar(dtype), dtype=dtype)
                if func is torch.ops.aten.copy_.default and not isinstance(args[0], FakeTensor):
                    return args[0].copy_(values)
                return values
        # host tensors meeting device ones become fakes here (FakeTensorMode would run an op on
        # host-only inputs for real, a copy to "cuda" included)
        args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if isinstance(tensor, FakeTensor) else self.from_tensor(tensor)

    def _scalar(self, dtype: torch.dtype) -> bool | int | float:
        if dtype == torch.bool:
            return False
        return float(self.token) if dtype.is_floating_point else self.token


@contextmanager
def fake_gpu(token: int = 0) -> Iterator[FakeGPU]:
    """Tensors made on "cuda" inside are fake; host reads of them are recorded on the yielded mode."""
    load_fake_cuda_guard()
    mode = FakeGPU(token)
    with mode:
        yield mode


def fake_model(config: dict[str, Any], dtype: torch.dtype, num_layers: int | None = None) -> CausalLM:
    """The model of a config.json's contents on the fake "cuda" device, weights uninitialised (call
    inside fake_gpu()); num_layers keeps only the first layers, to bound a test's time."""
    raw = dict(config, num_hidden_layers=num_layers) if num_layers is not None else config
    model_config = ModelConfig.from_dict(raw)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with unset_fake_temporarily(), torch.device("meta"):
            model = CausalLM(model_config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device="cuda")
    model.reset_buffers("cuda")
    return model.eval()
