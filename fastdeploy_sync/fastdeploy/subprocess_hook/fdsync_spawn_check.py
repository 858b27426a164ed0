"""Which child processes would start Python without the drop-in's hook, and the check armed
at every way a hooked process starts one.

The hook (this directory's ``sitecustomize``) runs in a Python process only when this
directory is on the ``PYTHONPATH`` the process starts with, ahead of any other
``sitecustomize``, and when the interpreter reads ``PYTHONPATH`` and runs ``site`` at all: a
child started with an environment that drops it, or with ``python -S``, ``-I`` or ``-E``, runs
no code of ours, so it cannot say that it kept FastDeploy's class. Its parent can: ``arm()``
wraps ``subprocess.Popen``, ``os.execv``/``os.execve`` (and so every ``os.exec*`` and
``os.spawn*``) and ``multiprocessing``'s spawn, and each child they start that is a Python
interpreter (by name, by being this interpreter, or by a ``#!`` line naming python) and
would lose the hook is reported on stderr, once per command, naming the parent, the command
and the reason; with ``FD_SYNC_RUN_STRICT=1`` the start raises ``PermissionError`` instead.
A shell command line (``shell=True``, or ``sh -c LINE``) is read for the Python commands in
it, with their ``VAR=value`` prefixes, ``export``, ``env -i``/``env -u``.

Not seen: what a shell script file or another program starts (only the start made from a
hooked Python process is checked), ``os.system``, ``os.posix_spawn`` called directly.

A top-level module (the directory is on ``sys.path`` in hooked processes), and the library's
``fastdeploy_sync.fastdeploy.subprocess_hook.fdsync_spawn_check``: standard library only, and
at a process's start nothing but ``os`` and ``sys`` (``re``/``shlex`` are imported by the
first check that needs them), so that a process that starts no child pays nearly nothing.
"""

import os
import sys

__all__ = ["HOOK_DIR", "lost_hook", "arm", "STRICT_ENV", "find_spec_then"]

HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
STRICT_ENV = "FD_SYNC_RUN_STRICT"

# Interpreter options that take an argument (``-X dev``, ``-W error``); ``-c``/``-m`` end them.
_WITH_ARGUMENT = {"X", "W", "Q"}
# What each option that loses the hook does.
_LOSES = {"S": "-S (no site: sitecustomize is not run)",
          "I": "-I (isolated: PYTHONPATH is ignored)",
          "E": "-E (PYTHON* variables are ignored, PYTHONPATH too)"}
_SHELLS = {"sh", "bash", "dash", "zsh", "ksh"}
_SHELL_WRAPPERS = {"exec", "nohup", "setsid", "nice", "command"}
_SHELL_SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", "\n"}
_warned: set = set()  # (reason, command) already reported by this process
_WARNED_MAX = 256


def _is_python_name(name):
    """``python``, ``python3``, ``python3.11``, ``python3.13t``...: an interpreter's name."""
    if not name.startswith("python"):
        return False
    rest = name[len("python"):]
    if rest[-1:] in ("d", "m", "u", "t"):
        rest = rest[:-1]
    return all(c.isdigit() or c == "." for c in rest)


def _environ(env):
    if env is None:
        return dict(os.environ)
    return {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}


def _which(program, env):
    if os.sep in program:
        return program
    for entry in env.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(entry or ".", program)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _interpreter_options(program, env):
    """``None`` if ``program`` is not a Python interpreter, else the options its ``#!`` line
    gives (``[]`` for an interpreter named as such)."""
    if _is_python_name(os.path.basename(program)):
        return []
    path = _which(program, env)
    if path is None:
        return None
    try:
        if os.path.realpath(path) == os.path.realpath(sys.executable):
            return []
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    for i, word in enumerate(words):
        if _is_python_name(os.path.basename(word)):
            return words[i + 1:]
    return None


def _option_letters(args):
    """The single-letter interpreter options of ``args`` (what follows the interpreter),
    up to the script, ``-c`` or ``-m``."""
    letters = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if not arg.startswith("-") or arg in ("-", "--") or arg.startswith("--"):
            break
        for j, ch in enumerate(arg[1:]):
            if ch in ("c", "m"):
                return letters
            letters.append(ch)
            if ch in _WITH_ARGUMENT:
                skip = j == len(arg) - 2  # the argument is the next word
                break
    return letters


def _pythonpath_problem(env):
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
    for entry in entries:
        path = os.path.abspath(entry)
        if path == HOOK_DIR:
            return None
        if os.path.isfile(os.path.join(path, "sitecustomize.py")):
            return (f"PYTHONPATH puts {entry}, which has a sitecustomize.py of its own, ahead of "
                    f"the hook directory {HOOK_DIR}")
    if not entries:
        return "its environment has no PYTHONPATH, so not the hook directory"
    return f"its PYTHONPATH ({env['PYTHONPATH']}) does not hold the hook directory {HOOK_DIR}"


def _python_command_problem(argv, env):
    """Why the process ``argv`` (environment ``env``) would not run the hook, or None."""
    if not argv:
        return None
    options = _interpreter_options(argv[0], env)
    if options is None:
        return None
    letters = _option_letters(options) + _option_letters(argv[1:])
    for letter in ("S", "I", "E"):
        if letter in letters:
            return f"the interpreter is started with {_LOSES[letter]}"
    return _pythonpath_problem(env)


def _shell_problem(line, env):
    """The first Python command of shell command line ``line`` that would lose the hook."""
    import shlex

    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:  # unbalanced quotes: the shell will refuse it anyway
        return None
    env = dict(env)
    command = []
    for word in words + [";"]:
        if word not in _SHELL_SEPARATORS:
            command.append(word)
            continue
        problem = _simple_command_problem(command, env)
        if problem:
            return problem
        command = []
    return None


def _expand(value, env):
    import re

    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)


def _simple_command_problem(words, env):
    """One shell command (``VAR=v ... [exec|env ...] program args``); ``env`` is the shell's
    environment, updated in place by ``export``."""
    if words and words[0] == "export":
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if eq:
                env[key] = _expand(value, env)
        return None
    own = dict(env)
    i = 0
    while i < len(words):
        word = words[i]
        key, eq, value = word.partition("=")
        if eq and key.isidentifier():
            own[key] = _expand(value, env)
        elif word == "env":
            i += 1
            while i < len(words) and (words[i].startswith("-") or "=" in words[i]):
                if words[i] in ("-i", "-", "--ignore-environment"):
                    own = {}
                elif words[i] == "-u" and i + 1 < len(words):
                    i += 1
                    own.pop(words[i], None)
                else:
                    key, eq, value = words[i].partition("=")
                    if eq:
                        own[key] = _expand(value, env)
                i += 1
            continue
        elif word not in _SHELL_WRAPPERS:
            return _python_command_problem(words[i:], own)
        i += 1
    return None


def lost_hook(args, env=None, shell=False, executable=None):
    """Why a process started as ``subprocess.Popen(args, executable=..., env=...,
    shell=...)`` would be a Python process without the drop-in's hook, or None (it keeps
    it, or it is no Python). ``env`` None: this process's environment. Reads at most the
    first 256 bytes of the program's file (its ``#!`` line); never raises for what it
    cannot read."""
    env = _environ(env)
    if isinstance(args, (str, bytes, os.PathLike)):
        args = [args]
    args = [os.fsdecode(a) for a in args]
    if shell:
        return _shell_problem(" ".join(args), env) if args else None
    if executable is not None:
        args = [os.fsdecode(executable)] + args[1:]
    line = _shell_line(args)
    if line is not None:
        return _shell_problem(line, env)
    return _python_command_problem(args, env)


def _shell_line(args):
    """LINE of ``sh [-options] -c LINE ...`` (``-c`` alone or among combined options, before
    the first operand), else None."""
    if not args or os.path.basename(args[0]) not in _SHELLS:
        return None
    for i, word in enumerate(args[1:], 1):
        if not word.startswith("-") or word == "--":
            return None
        if not word.startswith("--") and "c" in word[1:]:
            return args[i + 1] if i + 1 < len(args) else None
    return None


def _report(problem, args):
    command = args if isinstance(args, str) else " ".join(os.fsdecode(a) for a in args)
    if len(command) > 300:
        command = command[:300] + "..."
    message = (f"fastdeploy_sync: pid {os.getpid()} starts a Python process without the "
               f"FastDeploy drop-in's hook: {problem}. If it uses FastDeploy's "
               f"EngineWorkerQueue it keeps FastDeploy's class and cannot talk to the drop-in. "
               f"Keep the environment's PYTHONPATH (the hook directory first) and drop -S/-I/-E "
               f"there. Command: {command}")
    if os.environ.get(STRICT_ENV) == "1":
        raise PermissionError(message + f" (refused: {STRICT_ENV}=1)")
    key = (problem, command)
    if key in _warned:
        return
    if len(_warned) < _WARNED_MAX:
        _warned.add(key)
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # no usable stderr: the start goes on
        pass


def _check(args, env=None, shell=False, executable=None):
    try:
        problem = lost_hook(args, env, shell, executable)
    except Exception:  # noqa: BLE001 -- a check must never break the application's start
        return
    if problem:
        _report(problem, args)


def _marked(function):
    function.__fdsync_checked__ = True
    return function


def _arm_os():
    if getattr(os.execv, "__fdsync_checked__", False):
        return
    execv, execve = os.execv, os.execve

    @_marked
    def checked_execv(path, argv):
        _check([path] + list(argv)[1:])
        return execv(path, argv)

    @_marked
    def checked_execve(path, argv, env):
        _check([path] + list(argv)[1:], env)
        return execve(path, argv, env)

    checked_execv.__doc__, checked_execve.__doc__ = execv.__doc__, execve.__doc__
    os.execv, os.execve = checked_execv, checked_execve


def _arm_subprocess(module):
    popen = module.Popen
    if getattr(popen.__init__, "__fdsync_checked__", False):
        return
    original = popen.__init__
    code = original.__code__
    # Popen's positional parameters after self (args, bufsize, executable, ...), by name
    position = {n: i for i, n in enumerate(code.co_varnames[1:code.co_argcount])}

    def argument(name, args, kwargs, default):
        i = position.get(name)
        return args[i] if i is not None and i < len(args) else kwargs.get(name, default)

    @_marked
    def __init__(self, *args, **kwargs):
        _check(argument("args", args, kwargs, ()), argument("env", args, kwargs, None),
               argument("shell", args, kwargs, False),
               argument("executable", args, kwargs, None))
        original(self, *args, **kwargs)

    __init__.__doc__ = original.__doc__
    popen.__init__ = __init__


def _arm_multiprocessing(util):
    spawnv = getattr(util, "spawnv_passfds", None)
    if spawnv is None or getattr(spawnv, "__fdsync_checked__", False):
        return

    @_marked
    def spawnv_passfds(path, args, passfds):
        _check([path] + list(args)[1:])
        return spawnv(path, args, passfds)

    util.spawnv_passfds = spawnv_passfds


# Modules armed when imported (``arm_module``), and how.
ARMED_MODULES = {"subprocess": _arm_subprocess, "multiprocessing.util": _arm_multiprocessing}


def arm_module(module) -> None:
    """Arm ``module`` (one of ``ARMED_MODULES``) now; idempotent."""
    ARMED_MODULES[module.__name__](module)


def arm() -> None:
    """Check every child started from this process from now on (see the module docstring):
    ``os`` at once, ``subprocess`` and ``multiprocessing.util`` if imported already (the
    hook arms them when they are imported later, ``arm_module``). Idempotent."""
    _arm_os()
    for name in ARMED_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            arm_module(module)


class _ThenLoader:
    """A module's own loader, then ``then(module)`` once the module's code has run."""

    def __init__(self, loader, then):
        self._loader, self.then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self.then(module)

    def __getattr__(self, attr):  # anything else the module's own loader offers
        return getattr(self._loader, attr)


def find_spec_then(fullname, path, target, skip, then):
    """The spec that the finders of ``sys.meta_path`` other than ``skip`` (the caller)
    give for ``fullname``, its loader wrapped so that ``then(module)`` runs right after
    the module's own code (once: a loader wrapped for ``then`` already is kept); None when
    none finds it. How the hook arms ``subprocess`` when it is imported, and how
    ``install()`` swaps FastDeploy's class the moment its module has run."""
    for finder in sys.meta_path:
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            if spec.loader is not None and getattr(spec.loader, "then", None) is not then:
                spec.loader = _ThenLoader(spec.loader, then)
            return spec
    return None
