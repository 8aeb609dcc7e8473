"""What this CPU is and may run: its model name and feature flags (from /proc/cpuinfo), and whether AMX tiles
may be used by this process.

Linux hands out AMX's tile data (XTILEDATA, 8 KiB of state per thread) only to a process that asks for it with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; an AMX instruction run without that permission dies with
SIGILL even on a CPU that has it. `amx_state` asks once and says what came of it, so a kernel that would use the
tiles runs only after "granted" and every other answer falls back to the AVX-512 paths. oneDNN asks for itself
and takes AMX where it is granted; the kernel tuner (kernel_choice.py, kernel_timing.py) times it like any other
candidate.
"""
import ctypes
import errno
import functools
import platform

_SYS_ARCH_PRCTL = 158             # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
AMX_FLAGS = ("amx_tile", "amx_bf16")    # what a bf16 tile kernel needs (amx_int8 for an int8 one)


@functools.cache
def _cpuinfo() -> tuple[str, str]:
    """(model name, flags line) of the first processor; ("", "") where /proc/cpuinfo is not there."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def cpu_model() -> str:
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def flags_line() -> str:
    """The flags line as the kernel prints it (the compiled kernels' cache key), else the processor's name."""
    return _cpuinfo()[1] or platform.processor()


def cpu_flags() -> frozenset[str]:
    line = _cpuinfo()[1]
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def request_xtiledata() -> int:
    """Ask Linux for AMX tile data for this process: 0 when granted, else an errno value."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0:
        return 0
    return ctypes.get_errno() or errno.EPERM


def amx_state(flags: frozenset[str] | None = None, request=request_xtiledata) -> str:
    """"absent" (the CPU lacks AMX-BF16), "granted" (tile kernels may run), or "denied: <reason>" (the CPU has
    it but Linux refused the tile state: an old kernel, a seccomp filter; tile kernels must not run). flags and
    request are this CPU's and the real system call unless given."""
    flags = cpu_flags() if flags is None else flags
    if not all(f in flags for f in AMX_FLAGS):
        return "absent"
    err = request()
    return "granted" if err == 0 else f"denied: {errno.errorcode.get(err, err)}"


@functools.cache
def amx() -> str:
    """amx_state() of this process, asked once."""
    return amx_state()
