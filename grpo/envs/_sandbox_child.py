"""The python environment's child program: set up the sandbox, then run the model's code.

Started by `grpo.envs.sandbox.run_python` as ``python -s -P -u _sandbox_child.py CONFIG_JSON``
with a minimal environment; it imports nothing from grpo (it runs in the child's interpreter,
and after the mount step only the interpreter and its site-packages are visible). Linux only
for the isolated path; elsewhere (or with ``isolate: false``) it sets the resource limits and
runs the code in this process, as the resource boundary alone.

The isolated path, in processes (R is this process, in the caller's namespaces):

    R  writes C's uid/gid maps, waits for C, dies the way the code's process died
    C  unshare(user, mount, pid, network, ipc, uts); waits for I, passes the code's status up
    I  pid 1 of the new pid namespace: builds the new root (tmpfs; the interpreter, its
       prefixes and site-packages, /usr and the loader's libraries bound read-only; a private
       /proc; a few /dev nodes; the work directory as a size-capped tmpfs), pivots into it,
       drops to the sandbox uid, every capability and new privileges, applies Landlock where the
       kernel has it, reports the layers on the status pipe, forks P and reaps until P exits
       (when pid 1 exits the kernel kills everything left in the namespace)
    P  sets the resource limits (RLIMIT_NPROC among them) and runs the code

The status pipe (a file descriptor only R, C and I hold, closed before P starts) carries one
line to the caller: ``ok <json of the layers>`` just before P starts, or ``error <layer>:
<reason>`` when a layer could not be set up (the code never runs then). The code cannot write
to it, so nothing the code does can forge a setup failure or a layer report.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys

EXIT_EXCEPTION, EXIT_MEMORY, EXIT_FILE_SIZE, EXIT_SETUP = 112, 113, 114, 115
SANDBOX_ID = 1000  # the code's uid and gid inside the user namespace

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH, AT_RECURSIVE, AT_FDCWD = 2, 0x8000, -100
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_MOUNT_SETATTR = 442
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

# System directories the interpreter and its extension modules load from (bound read-only when
# they exist; recreated as symlinks where they are symlinks, as on merged-/usr systems).
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
DEV_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A sandbox layer could not be set up: (layer, reason)."""

    def __init__(self, layer, reason):
        super().__init__(f"{layer}: {reason}")
        self.layer = layer


def check(result, layer, what):
    if result == -1:
        errno = ctypes.get_errno()
        raise SetupError(layer, f"{what}: {os.strerror(errno)}")
    return result


def mount(source, target, fstype, flags, data, layer="mount"):
    check(
        libc.mount(
            source and source.encode(),
            target.encode(),
            fstype and fstype.encode(),
            ctypes.c_ulong(flags),
            data and data.encode(),
        ),
        layer,
        f"mount {target}",
    )


# ------------------------------------------------------------------------------ limits, code


def cap(which, soft, hard):
    limit = resource.getrlimit(which)[1]
    if limit != resource.RLIM_INFINITY:
        soft, hard = min(soft, limit), min(hard, limit)
    resource.setrlimit(which, (soft, hard))


def run_code(source, cfg):
    """Set the limits and execute the code in this process; never returns."""
    cap(resource.RLIMIT_CORE, 0, 0)
    cap(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)
    cap(resource.RLIMIT_FSIZE, cfg["file_bytes"], cfg["file_bytes"])
    cap(resource.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"])
    if cfg.get("nproc"):
        cap(resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])
    cap(resource.RLIMIT_AS, cfg["as_bytes"], cfg["as_bytes"])
    sys.argv = ["<code>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "<code>", "exec"), namespace)
    except SystemExit as e:
        code = e.code
        flush()
        if code is None or code is True or code is False:
            os._exit(int(bool(code)))
        if isinstance(code, int):
            os._exit(code & 0xFF)
        os.write(2, f"\n{code}\n".encode("utf-8", "replace"))
        os._exit(1)
    except BaseException as e:
        namespace.clear()
        if isinstance(e, MemoryError):
            os.write(2, b"\nMemoryError\n")
            os._exit(EXIT_MEMORY)
        code = EXIT_FILE_SIZE if isinstance(e, OSError) and e.errno == 27 else EXIT_EXCEPTION
        try:
            text = str(e)
        except BaseException:
            text = ""
        line = type(e).__name__ + (": " + " ".join(text.split()) if text.strip() else "")
        flush()
        os.write(2, ("\n" + line + "\n").encode("utf-8", "replace"))
        os._exit(code)
    flush()
    os._exit(0)


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


# ------------------------------------------------------------------------------ process tree


def die_like(status):
    """End this process the way a child with wait status `status` ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL, SIGSTOP: default already
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal this process could not die of (e.g. blocked)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else EXIT_SETUP)


def report(fd, line):
    if fd is not None:
        os.write(fd, (line + "\n").encode())


def id_maps(pid, uid, gid):
    """Map SANDBOX_ID in C's user namespace: to a uid no one else uses when this process may
    (root: the code's processes then share no uid with the caller, so RLIMIT_NPROC counts them
    alone and no file of the caller's is theirs), else to the caller's own ids."""
    proc = f"/proc/{pid}"
    if os.geteuid() == 0:
        fresh = 0x7F000000 + pid % 0x10000
        try:
            with open(f"{proc}/uid_map", "w") as f:
                f.write(f"{SANDBOX_ID} {fresh} 1")
            with open(f"{proc}/gid_map", "w") as f:
                f.write(f"{SANDBOX_ID} {fresh} 1")
            return "fresh uid"
        except OSError:
            pass
    try:
        with open(f"{proc}/setgroups", "w") as f:
            f.write("deny")
        with open(f"{proc}/uid_map", "w") as f:
            f.write(f"{SANDBOX_ID} {uid} 1")
        with open(f"{proc}/gid_map", "w") as f:
            f.write(f"{SANDBOX_ID} {gid} 1")
    except OSError as e:
        raise SetupError("user", f"uid map: {e.strerror}") from None
    return "caller's uid"


def isolated(source, cfg, status_fd):
    """R: start C and wait for it; C and I never return."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    uid, gid = os.geteuid(), os.getegid()
    pid = os.fork()
    if pid == 0:  # C
        os.close(ready_r)
        os.close(go_w)
        try:
            check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pid", "pdeathsig")
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
            check(libc.unshare(flags | CLONE_NEWUTS), "user", "unshare")
        except SetupError as e:
            report(status_fd, f"error {e}")
            os._exit(EXIT_SETUP)
        os.write(ready_w, b"u")
        os.close(ready_w)
        user = os.read(go_r, 64).decode()
        if not user:
            os._exit(EXIT_SETUP)  # R reported the failure
        os.close(go_r)
        cfg["user"] = user
        sandbox_parent(source, cfg, status_fd)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"u":
        try:
            os.write(go_w, id_maps(pid, uid, gid).encode())
        except SetupError as e:
            report(status_fd, f"error {e}")
    os.close(go_w)
    if status_fd is not None:
        os.close(status_fd)
    _, status = os.waitpid(pid, 0)
    die_like(status)


def sandbox_parent(source, cfg, status_fd):
    """C: fork I (pid 1 of the new namespace), pass P's wait status up when I ends."""
    code_r, code_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(code_r)
        init(source, cfg, status_fd, code_w)
    os.close(code_w)
    if status_fd is not None:
        os.close(status_fd)
    _, status = os.waitpid(pid, 0)
    data = os.read(code_r, 4)
    die_like(struct.unpack("i", data)[0] if len(data) == 4 else status)


def init(source, cfg, status_fd, code_w):
    """I: build the sandbox, start P, reap everything until P exits."""
    try:
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pid", "pdeathsig")
        layers = build(cfg)
    except SetupError as e:
        report(status_fd, f"error {e}")
        os._exit(EXIT_SETUP)
    except OSError as e:
        report(status_fd, f"error mount: {e.strerror} ({e.filename})")
        os._exit(EXIT_SETUP)
    report(status_fd, "ok " + json.dumps(layers, separators=(",", ":")))
    if status_fd is not None:
        os.close(status_fd)
    code = os.fork()
    if code == 0:  # P
        os.close(code_w)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self readable again
        os.setsid()  # kill(0, ...) reaches only the code's own processes
        os.chdir(cfg["work"])
        run_code(source, cfg)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # P cannot open pid 1's file descriptors
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        if pid == code:
            os.write(code_w, struct.pack("i", status))
            os._exit(0)  # the kernel now kills what is left in the namespace


# ------------------------------------------------------------------------------ the layers


def build(cfg):
    """I's setup, in order; returns the layers that applied (every required one, or raises)."""
    layers = {
        "user": cfg.get("user", "caller's uid"),
        "pid": True,
        "network": True,
        "ipc": True,
        "uts": True,
    }
    check(libc.sethostname(b"sandbox", 7), "uts", "sethostname")
    # What to bind, resolved while this process still has the caller's file access (a root
    # caller's home may be closed to the sandbox uid): O_PATH descriptors, bound through
    # /proc/self/fd once the uid has changed, all closed before the code runs.
    paths, sources = [], []
    for path in sorted(set(SYSTEM_DIRS + tuple(cfg["binds"]))):
        if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths):
            paths.append(path)
    required = set(cfg["binds"]) | {"/dev/null"}
    for path in (*paths, *ETC_FILES, *DEV_NODES):
        spec = resolve(path, path in required)
        if spec is not None:
            sources.append(spec)
    try:
        # the new root, entered while the caller's file access still reaches its directory
        mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        options = f"size=1m,nr_inodes=4096,mode=755,uid={SANDBOX_ID},gid={SANDBOX_ID}"
        mount("tmpfs", cfg["root"], "tmpfs", MS_NOSUID | MS_NODEV, options)
        os.chdir(cfg["root"])
        libc.setgroups(0, None)  # refused where setgroups is denied: the caller's groups stay
        check(libc.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID), "user", "setresgid")
        check(libc.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID), "user", "setresuid")
        layers.update(new_root(cfg, sources))
    finally:
        for spec in sources:
            if spec[2] is not None:
                os.close(spec[2])
    layers.update(drop_privileges())
    layers["landlock"] = landlock(cfg["work"])
    layers["nproc"] = cfg.get("nproc") or 0
    return layers


def resolve(path, required):
    """(path, symlink target or None, O_PATH fd or None, is a directory), or None: absent."""
    if not os.path.lexists(path):
        if required:
            raise SetupError("mount", f"{path}: not found")
        return None
    if os.path.islink(path) and os.path.dirname(path) == "/":  # /lib -> usr/lib
        return path, os.readlink(path), None, False
    source = os.path.realpath(path)
    fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
    return path, None, fd, os.path.isdir(source)


def new_root(cfg, sources):
    """Fill the new root (the current directory, a tmpfs) with only what the interpreter needs,
    read-only, and pivot into it. Paths are relative: "." is the new root."""
    work = cfg["work"]
    for path, link, fd, is_dir in sources:
        target = "." + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if link is not None:
            os.symlink(link, target)
            continue
        if is_dir:
            os.makedirs(target, exist_ok=True)
        else:
            open(target, "w").close()
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None)
        read_only(target, is_dir, device=path.startswith("/dev/"))
    os.makedirs("./proc", exist_ok=True)
    try:
        mount("proc", "./proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        proc = True
    except SetupError:
        proc = False  # e.g. a container whose /proc has parts masked: the sandbox has none
    os.makedirs("." + work, exist_ok=True)
    size = f"size={cfg['dir_bytes']},nr_inodes=1024,mode=700,uid={SANDBOX_ID},gid={SANDBOX_ID}"
    mount("tmpfs", "." + work, "tmpfs", MS_NOSUID | MS_NODEV, size)
    pivot = getattr(libc, "pivot_root", None)
    if pivot is not None:
        check(pivot(b".", b"."), "mount", "pivot_root")
    else:
        number = SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise SetupError("mount", f"pivot_root: unknown on {os.uname().machine}")
        check(libc.syscall(number, b".", b"."), "mount", "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "mount", "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    if proc:  # no nested user namespaces (best effort: the limit is this namespace's own)
        try:
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        except OSError:
            pass
    return {"mount": True, "proc": proc}


def read_only(target, is_dir, device):
    """Make a bound tree read-only (/dev/null stays writable), nosuid and nodev (a device node
    keeps its dev flag); every mount in it with mount_setattr (Linux 5.12), else the top one."""
    rdonly = 0 if target.endswith("/dev/null") else 1
    flags = rdonly | 2 | (0 if device else 4)  # MOUNT_ATTR_ RDONLY | NOSUID | NODEV
    attr = struct.pack("QQQQ", flags, 0, 0, 0)
    if (
        libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, attr, ctypes.c_size_t(32)
        )
        == 0
    ):
        return
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY if rdonly else 0)
    mount(None, target, None, flags | (0 if device else MS_NODEV), None)


def drop_privileges():
    """The sandbox uid, no supplementary groups, no capabilities, no new privileges."""
    libc.setgroups(0, None)  # refused where setgroups is denied: the caller's groups stay
    check(libc.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID), "user", "setresgid")
    check(libc.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID), "user", "setresuid")
    for number in range(64):
        if libc.prctl(PR_CAPBSET_DROP, number, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            raise SetupError("capabilities", f"bounding set: {os.strerror(ctypes.get_errno())}")
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, bytes(24)), "capabilities", "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs", "prctl")
    return {"capabilities": "none", "no_new_privs": True}


def landlock(work):
    """Landlock where the kernel has it: read and execute everywhere in the new root, write only
    in the work directory and /dev/null; no TCP bind or connect (ABI 4); no abstract Unix socket
    and no signal to a process outside the sandbox (ABI 6). Returns the ABI applied, 0 if none."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    fs |= 1 << 15 if abi >= 5 else 0
    net = 3 if abi >= 4 else 0  # BIND_TCP | CONNECT_TCP: no rule allows either
    scoped = 3 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET | SIGNAL
    attr = struct.pack("QQQ", fs, net, scoped)[: 24 if abi >= 6 else 16 if abi >= 4 else 8]
    ruleset = check(
        libc.syscall(
            SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0)
        ),
        "landlock",
        "create ruleset",
    )
    read = 1 | 4 | 8  # EXECUTE | READ_FILE | READ_DIR
    file_rights = 1 | 2 | 4 | (1 << 14 if abi >= 3 else 0)  # EXECUTE WRITE_FILE READ_FILE TRUNC
    try:
        for path, rights in (("/", read), (work, fs), ("/dev/null", file_rights & ~1)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", rights, fd)
                check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), "landlock", path)
            finally:
                os.close(fd)
        check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock", "restrict")
    finally:
        os.close(ruleset)
    return abi


def interpreter_paths():
    """What the code's interpreter loads from: its prefixes, its executable's directory and the
    site-packages directories on its path (other sys.path entries, such as an editable
    install's source tree or PYTHONPATH directories, are left out)."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
    }
    paths.update(p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages"))
    return sorted(p for p in paths if p and os.path.isdir(p))


def main():
    cfg = json.loads(sys.argv[1])
    cfg["binds"] = interpreter_paths()
    with open(cfg["code"], encoding="utf-8") as f:
        source = f.read()
    status_fd = cfg.get("status_fd")
    if not cfg["isolate"]:
        if cfg.get("network"):  # the resource boundary's one namespace, where it can be had
            legacy_network()
        report(status_fd, "ok {}")
        if status_fd is not None:
            os.close(status_fd)
        run_code(source, cfg)
    try:
        isolated(source, cfg, status_fd)
    except SetupError as e:
        report(status_fd, f"error {e}")
        os._exit(EXIT_SETUP)


def legacy_network():
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        try:
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        except OSError:
            pass


if __name__ == "__main__":
    main()
