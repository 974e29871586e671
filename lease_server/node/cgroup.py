"""GPU isolation by the OS: each lease's workers run in a cgroup of their own whose device rules let
them open only the leased GPUs' device nodes, as Slurm's ``ConstrainDevices`` does. Opening another
GPU then fails with EPERM whatever ``CUDA_VISIBLE_DEVICES`` says.

The rule, on either kind of host: every NVIDIA GPU node (character major 195, minors 0..253) is
denied except the leased GPUs'; everything else stays allowed: ``/dev/nvidiactl`` (195:255) and
``/dev/nvidia-modeset`` (195:254), which CUDA opens for any GPU, ``nvidia-uvm`` and ``nvidia-caps``
(dynamic majors, so they need no entry and /proc/devices need not be read), and the rest of the
system's devices. A leased GPU's minor is read from its ``/dev/nvidia<index>`` node, since NVML's
index and the node's minor need not agree; the index is the fallback where no node exists.

* **cgroup v1** (the ``devices`` controller): ``<root>/devices/<name>/<lease>/``. A v1 list is either
  "deny all, with allow exceptions" or "allow all, with deny exceptions"; a new cgroup inherits its
  parent's, here allow-all. Only exact entries can be removed again: ``deny c 195:* rwm`` followed
  by ``allow c 195:0 rwm`` still denies 195:0, so every denied minor is an entry of its own.
  ``devices.list`` shows just ``a *:* rwm`` in allow-all mode: the exceptions cannot be read back.
* **cgroup v2**: no device files; a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program, loaded with bpf(2)
  and attached to ``<root>/<name>/<lease>/``, answers each open (1 allow, 0 deny). No well-kept
  Python library loads one (bcc and libbpf's bindings compile C with clang), so a short ctypes
  loader of hand-assembled instructions does it below.

cgroup v1 is used where its devices controller is mounted (also on a hybrid host), else v2. A
process moved into a cgroup keeps it for the children it forks later. A root process in the
cgroup could rewrite its rules; lease workers are not root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import re
import resource
import stat
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
LAST_GPU_MINOR = 253  # 254 is nvidia-modeset, 255 nvidiactl: never denied
LEASE_ID = re.compile(r"l-[0-9a-f]{1,64}")
V1 = "cgroup v1 devices"
V2 = "cgroup v2 BPF"
OFF = "GPU device isolation is off; unleased use is judged from NVML samples"


@dataclass(frozen=True)
class Unavailable:
    """Why this node cannot isolate GPUs by cgroup: one line for a person (the agent logs it at
    start and ``gpulease status`` shows it)."""

    reason: str


def gpu_minors(gpu_indexes: list[int], dev: str = "/dev") -> set[int]:
    """The minor numbers of the leased GPUs' device nodes: ``st_rdev`` of ``<dev>/nvidia<index>``
    where that is an NVIDIA character device, else the index itself."""
    minors = set()
    for index in gpu_indexes:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= LAST_GPU_MINOR:
            raise ValueError(f"not a GPU index: {index!r}")
        try:
            st = os.stat(os.path.join(dev, f"nvidia{index}"))
        except OSError:
            minors.add(index)
            continue
        if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR:
            minors.add(os.minor(st.st_rdev))
        else:
            minors.add(index)
    return minors


class DeviceIsolation:
    """Per-lease cgroups whose device rules allow only the leased GPUs' device nodes (plus the
    control devices CUDA needs), as Slurm's ConstrainDevices does. Made by :meth:`detect`."""

    dev = "/dev"  # where the leased GPUs' nodes are read (a test points it at nodes it made)

    def __init__(self, kind: str, base: str) -> None:
        self.kind = kind  # V1 or V2
        self.base = base  # the directory holding one cgroup per lease

    def __repr__(self) -> str:
        return f"DeviceIsolation({self.kind!r}, {self.base!r})"

    @classmethod
    def detect(cls, root: str = "/sys/fs/cgroup", name: str = "gpulease") -> DeviceIsolation | Unavailable:
        """What this host allows: v1's devices controller under ``root/devices``, else cgroup2 at
        ``root`` (or ``root/unified`` on a hybrid host) with BPF device programs; each is tried
        for real (a probe cgroup gets the rules, then is removed)."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise ValueError(f"not a cgroup name: {name!r}")
        if os.geteuid() != 0:
            return Unavailable(f"not root: {OFF}")
        if os.path.exists(os.path.join(root, "devices", "devices.deny")):
            kind, base = V1, os.path.join(root, "devices", name)
        else:
            unified = (root, os.path.join(root, "unified"))  # pure v2, or a hybrid host's
            v2 = [d for d in unified if os.path.exists(os.path.join(d, "cgroup.controllers"))]
            if not v2:
                return Unavailable(f"no cgroup v1 devices controller nor cgroup2 under {root}: {OFF}")
            kind, base = V2, os.path.join(v2[0], name)
        self = cls(kind, base)
        probe = os.path.join(base, "probe")
        try:
            os.makedirs(probe, exist_ok=True)
            try:
                self._apply(probe, set())
            finally:
                os.rmdir(probe)
        except OSError as exc:
            return Unavailable(f"{kind} cannot be used at {base} ({exc.strerror or exc}): {OFF}")
        log.info("GPU device isolation: %s at %s", kind, base)
        return self

    def path(self, lease_id: str) -> str:
        """The lease's cgroup directory; ValueError unless ``lease_id`` looks like ``l-<hex>``."""
        if not isinstance(lease_id, str) or not LEASE_ID.fullmatch(lease_id):
            raise ValueError(f"not a lease id: {lease_id!r}")
        return os.path.join(self.base, lease_id)

    def place(self, lease_id: str, pid: int, gpu_indexes: list[int]) -> None:
        """Create (or reuse) the lease's cgroup with its device rules, and move pid into it (its
        later children inherit it). The rules are written before the move, so the process never
        runs there unconfined; placing again with other GPUs rewrites them, denials first."""
        path = self.path(lease_id)
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
            raise ValueError(f"not a pid to confine: {pid!r}")
        if not os.path.exists(f"/proc/{pid}"):
            raise ProcessLookupError(errno.ESRCH, f"no process {pid}")
        minors = gpu_minors(gpu_indexes, self.dev)
        os.makedirs(path, exist_ok=True)
        self._apply(path, minors)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        log.info("lease %s: pid %s confined to GPU nodes %s (%s)", lease_id, pid, sorted(minors), self.kind)

    def _apply(self, path: str, allowed: set[int]) -> None:
        if self.kind == V1:
            # One entry per write: the kernel parses a single rule from each.
            fd = os.open(os.path.join(path, "devices.deny"), os.O_WRONLY)
            try:
                for m in (m for m in range(LAST_GPU_MINOR + 1) if m not in allowed):
                    os.write(fd, f"c {NVIDIA_MAJOR}:{m} rwm".encode())
            finally:
                os.close(fd)
            fd = os.open(os.path.join(path, "devices.allow"), os.O_WRONLY)
            try:
                for m in sorted(allowed):  # removes a denial an earlier placement wrote
                    os.write(fd, f"c {NVIDIA_MAJOR}:{m} rwm".encode())
            finally:
                os.close(fd)
        else:
            prog = _load_device_program(allowed)
            try:
                _attach(prog, path)
            finally:
                os.close(prog)

    def pids(self, lease_id: str) -> list[int]:
        """Every process now in the lease's cgroup ([] if it has none or the cgroup is gone)."""
        try:
            with open(os.path.join(self.path(lease_id), "cgroup.procs")) as f:
                return sorted({int(line) for line in f if line.strip()})
        except FileNotFoundError:
            return []

    def remove(self, lease_id: str) -> None:
        """Remove the lease's cgroup once its processes are gone (no error if it is absent; EBUSY
        while a process remains). A v2 program goes with its cgroup."""
        try:
            os.rmdir(self.path(lease_id))
        except FileNotFoundError:
            return
        log.info("lease %s: cgroup removed", lease_id)

    def leases(self) -> list[str]:
        """The lease cgroups that exist (an agent restarted removes those of ended leases)."""
        try:
            names = os.listdir(self.base)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if LEASE_ID.fullmatch(n) and os.path.isdir(os.path.join(self.base, n)))


# ---- cgroup v2: a BPF device program, loaded and attached with bpf(2) through ctypes -------------

_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
_BPF_PROG_LOAD, _BPF_PROG_ATTACH = 5, 8
_BPF_PROG_TYPE_CGROUP_DEVICE = 15
_BPF_CGROUP_DEVICE = 6  # attach type
_BPF_DEVCG_DEV_CHAR = 2  # low 16 bits of bpf_cgroup_dev_ctx.access_type


class _ProgLoad(ctypes.Structure):  # the head of union bpf_attr for BPF_PROG_LOAD
    _fields_ = [
        ("prog_type", ctypes.c_uint32),
        ("insn_cnt", ctypes.c_uint32),
        ("insns", ctypes.c_uint64),
        ("license", ctypes.c_uint64),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_uint64),
    ]


class _ProgAttach(ctypes.Structure):  # the head of union bpf_attr for BPF_PROG_ATTACH
    _fields_ = [
        ("target_fd", ctypes.c_uint32),
        ("attach_bpf_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("attach_flags", ctypes.c_uint32),
    ]


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One eBPF instruction: opcode, dst and src registers (4 bits each), 16-bit offset, 32-bit imm."""
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(allowed: set[int]) -> bytes:
    """The eBPF program: r1 points at ``struct bpf_cgroup_dev_ctx {u32 access_type, major, minor}``;
    return 0 (EPERM) for a character device 195:m with m <= 253 not in ``allowed``, else 1."""
    LDXW, AND32_K, MOV64_K, EXIT = 0x61, 0x54, 0xB7, 0x95
    JEQ_K, JGT_K, JNE_K = 0x15, 0x25, 0x55
    minors = sorted(m for m in allowed if m <= LAST_GPU_MINOR)
    n = 7 + len(minors) + 4  # every test below jumps to "allow", the last two instructions
    allow = n - 2

    def to_allow(code: int, imm: int) -> bytes:  # if r2 <code> imm: goto allow
        return _insn(code, dst=2, off=allow - (len(insns) + 1), imm=imm)

    insns: list[bytes] = [_insn(LDXW, dst=2, src=1, off=0)]  # r2 = ctx->access_type
    insns.append(_insn(AND32_K, dst=2, imm=0xFFFF))  # r2 &= 0xffff: the device type
    insns.append(to_allow(JNE_K, _BPF_DEVCG_DEV_CHAR))  # a block device
    insns.append(_insn(LDXW, dst=2, src=1, off=4))  # r2 = ctx->major
    insns.append(to_allow(JNE_K, NVIDIA_MAJOR))
    insns.append(_insn(LDXW, dst=2, src=1, off=8))  # r2 = ctx->minor
    insns.append(to_allow(JGT_K, LAST_GPU_MINOR))  # nvidia-modeset, nvidiactl
    for m in minors:  # a leased GPU
        insns.append(to_allow(JEQ_K, m))
    insns += [_insn(MOV64_K, dst=0, imm=0), _insn(EXIT), _insn(MOV64_K, dst=0, imm=1), _insn(EXIT)]
    assert len(insns) == n
    return b"".join(insns)


def _bpf(cmd: int, attr: ctypes.Structure) -> int:
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf(2) number unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ret = libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"bpf: {os.strerror(e)}")
    return int(ret)


def _load_device_program(allowed: set[int]) -> int:
    """Load :func:`device_program`; its fd. On failure the verifier's log is in the error."""
    code = device_program(allowed)
    insns = ctypes.create_string_buffer(code, len(code))
    license = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoad(_BPF_PROG_TYPE_CGROUP_DEVICE, len(code) // 8, ctypes.addressof(insns), ctypes.addressof(license))
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            # Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK, often 64 KiB: root may raise it.
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                return _bpf(_BPF_PROG_LOAD, attr)
        if exc.errno not in (errno.EINVAL, errno.EACCES):
            raise
    buf = ctypes.create_string_buffer(1 << 16)  # load again with the verifier's log
    attr.log_level, attr.log_size, attr.log_buf = 1, len(buf), ctypes.addressof(buf)
    try:
        return _bpf(_BPF_PROG_LOAD, attr)
    except OSError as exc:
        raise OSError(exc.errno, f"BPF device program refused: {buf.value.decode(errors='replace').strip()}") from exc


def _attach(prog: int, path: str) -> None:
    """Attach ``prog`` to the cgroup directory ``path``. Without BPF_F_ALLOW_MULTI an attached
    program replaces the one there, in one step: a lease placed again never runs unconfined."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _bpf(_BPF_PROG_ATTACH, _ProgAttach(fd, prog, _BPF_CGROUP_DEVICE, 0))
    finally:
        os.close(fd)
