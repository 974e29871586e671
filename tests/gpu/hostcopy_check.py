"""A CUDA tensor, module and optimizer state that a warm cell brings back arrive in the CPU kernel
as CPU objects (magics/hostcopy.py), where plain pickle refuses them ("Attempting to deserialize
object on a CUDA device"). Run on a machine with an NVIDIA GPU and torch with CUDA:

    PYTHONPATH=. python3 tests/gpu/hostcopy_check.py

Prints what it sees and ends with one JSON line. Not a pytest module.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import torch

from magics import hostcopy
from magics.calls import CellValue

model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
model(torch.randn(64, 1024, device="cuda")).sum().backward()
opt.step()
big = torch.randn(64 << 20, device="cuda")  # 256 MB: named in the closing line
ptr = model[0].weight.data_ptr()
t0 = time.perf_counter()
packed = hostcopy.pack(CellValue({"model": model, "opt": opt.state_dict(), "big": big}, model[0].weight[:2]))
pack_s = time.perf_counter() - t0
plain_refused = ""
try:  # what a CPU-only kernel got before: torch's own pickle of a CUDA tensor
    data = pickle.dumps(model[0].weight)
    r = subprocess.run(
        [sys.executable, "-c", "import pickle, sys, torch; pickle.loads(sys.stdin.buffer.read())"],
        input=data,
        capture_output=True,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    plain_refused = r.stderr.decode().strip().splitlines()[-1] if r.returncode else "(loaded)"
except Exception as exc:  # noqa: BLE001
    plain_refused = repr(exc)
code = (
    "import pickle, sys, torch\n"
    "from magics import hostcopy\n"
    "value, big = hostcopy.unpack(pickle.loads(sys.stdin.buffer.read()))\n"
    "m = value.names['model']\n"
    "print(m[0].weight.device, value.result.device, value.names['opt']['state'][0]['exp_avg'].device,"
    " [b.text() for b in big], float(m(torch.ones(1, 1024)).sum()) == float(m(torch.ones(1, 1024)).sum()))\n"
)
r = subprocess.run(
    [sys.executable, "-c", code],
    input=pickle.dumps(packed),
    capture_output=True,
    env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": "."},
)
print("kernel side:", r.stdout.decode().strip(), r.stderr.decode()[-500:])
print("plain pickle in a CPU-only process:", plain_refused)
print(
    json.dumps(
        {
            "kernel_ok": r.returncode == 0 and "cpu cpu cpu" in r.stdout.decode(),
            "gpu_original_kept": model[0].weight.is_cuda and model[0].weight.data_ptr() == ptr,
            "pack_s": round(pack_s, 3),
        }
    )
)
