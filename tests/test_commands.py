"""The `tv-ray` command at the terminal: exit codes, messages instead of tracebacks, settings checked up front, one
set of defaults, Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tv_ray.api import verify
from tv_ray.cli import build_parser, main
from tv_ray.commands import _descendants
from tv_ray.errors import SettingsError

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tv-ray"), *argv], capture_output=True, text=True, env=ENV, timeout=300, **kw)


def test_unknown_solvers_and_bad_timeouts_are_refused_before_anything_runs(tmp_path, capsys):
    for argv, message in ((["--solvers", "z3,nosuch"], "argument --solvers: unknown solver 'nosuch'; choose from "
                                                        "z3,cvc5,yices"),
                          (["--timeout", "-1"], "argument --timeout: -1: a timeout must be a positive number of "
                                                "seconds"),
                          (["--timeout", "soon"], "argument --timeout: 'soon' is not a number of seconds")):
        with pytest.raises(SystemExit) as exit_:
            main(["verify", "--model", "llama3-tiny", "--parallel", "dp=2", "-o", str(tmp_path / "o"), *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SettingsError, match=r"^solvers z3,nosuch: unknown 'nosuch'; choose from z3,cvc5,yices$"):
        verify("llama3-tiny", "dp=2", solvers=("z3", "nosuch"), engine="local")
    with pytest.raises(SettingsError, match=r"^timeout 0: a solver timeout must be a positive number of seconds$"):
        verify("llama3-tiny", "dp=2", timeout=0, engine="local")


def test_the_command_runs_with_the_cyclic_collector_off_to_its_end(monkeypatch, capsys):
    """`tv-ray` (`entry`) turns the collector off for good: turned back on after a verification, its first pass
    would walk every object the verification made, only for the process to end."""
    import gc
    import os
    from tv_ray import cli
    monkeypatch.setattr(sys, "argv", ["tv-ray", "models"])
    ended = []
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setattr(cli.atexit, "_run_exitfuncs", lambda: ended.append("handlers"))
    try:
        cli.entry()
        assert ended == ["handlers", 0] and not gc.isenabled()
        assert "llama3-tiny" in capsys.readouterr().out
    finally:
        gc.enable()


class _Made:
    """Something a command made (weakly referable)."""


def test_what_a_command_made_is_held_to_the_end_only_of_a_process_that_ends_unfreed(monkeypatch):
    import weakref
    from tv_ray import processes
    monkeypatch.setattr(processes, "_HELD", None)
    made = _Made()
    gone = weakref.ref(made)
    processes.held_to_exit(made)            # the Python API: nothing kept
    del made
    assert gone() is None
    processes.ends_unfreed()                # `tv-ray`: kept to the process's end
    made = _Made()
    kept = weakref.ref(made)
    processes.held_to_exit(made)
    del made
    assert kept() is not None


def test_the_command_ends_with_its_code_after_its_exit_handlers_and_output():
    script = ("import atexit, sys; from tv_ray.cli import entry; "
              "atexit.register(lambda: print('handler ran', file=sys.stderr)); "
              "sys.argv = ['tv-ray'] + sys.argv[1:]; entry()")
    ok = subprocess.run([sys.executable, "-c", script, "models"], capture_output=True, text=True, timeout=120)
    assert (ok.returncode, ok.stderr) == (0, "handler ran\n") and "llama3-405b" in ok.stdout
    bad = subprocess.run([sys.executable, "-c", script, "check", "/nonexistent/out"], capture_output=True, text=True,
                         timeout=120)
    assert (bad.returncode, bad.stderr) == (1, "tv-ray check: FAILED: /nonexistent/out/certificate.json: no certificate "
                                               "here (a run that was not proved writes report.json)\nhandler ran\n")


def test_a_plan_path_is_a_plan_whatever_its_name_and_a_bad_name_says_so(tiny_dp2_plan, tmp_path, capsys):
    odd = tmp_path / "plan.v2"
    tiny_dp2_plan.save(odd)
    assert main(["verify", str(odd), "-o", str(tmp_path / "out"), "-q", "--engine", "local"]) == 0
    assert main(["verify", str(tmp_path / "nosuch.plan"), "-o", str(tmp_path / "o2"), "--engine", "local"]) == 2
    assert capsys.readouterr().err.startswith(f"tv-ray verify: {tmp_path / 'nosuch.plan'}: no such plan file, and "
                                              f"not a built-in model (llama3-tiny, ")


def test_plan_and_verify_share_one_set_of_defaults_and_show_them():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    flags = {name: {o: a for a in sub[name]._actions for o in a.option_strings} for name in ("plan", "verify")}
    for option in ("--model", "--parallel", "--sp", "--zero", "--tied", "--untied", "--masked-targets", "--optim",
                   "--clip", "--dims"):
        assert (flags["plan"][option].help, flags["plan"][option].default) == \
            (flags["verify"][option].help, flags["verify"][option].default), option
    assert (flags["verify"]["--optim"].default, flags["verify"]["--clip"].default) == ("sgd", None)
    for name in ("plan", "verify"):
        text = " ".join(sub[name].format_help().split())
        assert "(default: sgd)" in text and "(default: no clipping)" in text and "(default: 0)" in text
    verify_help = " ".join(sub["verify"].format_help().split())
    assert "(default: z3,cvc5,yices)" in verify_help and "(default: 10.0)" in verify_help


def test_masked_targets_are_in_the_plan_and_its_recipe_and_a_fresh_capture_matches(tmp_path):
    """`--masked-targets`: the targets input may hold the loss's ignore_index, the recipe says so, and verify
    compares the plan with a fresh capture made the same way."""
    from tv_ray.plan import Plan
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama3-tiny", "--parallel", "dp=2", "--masked-targets", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert [(s.name, s.ignore) for s in plan.logical.inputs if s.dtype == "int"] == [("tokens", None),
                                                                                   ("targets", -100)]
    assert plan.recipe["masked"] is True
    result = verify(str(out), engine="local", progress=False)
    assert result.proved and "a fresh capture of llama3-tiny (sgd, no clipping, masked targets)" in \
        result.report["headline"]


def test_plan_output_onto_a_directory_or_under_a_file_is_a_message(tmp_path):
    done = _run("plan", "--model", "llama3-tiny", "--parallel", "dp=2", "-o", str(tmp_path))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"tv-ray plan: -o {tmp_path} is a directory; give the plan file's path, e.g. "
                           f"{tmp_path / 'plan.json'}\n")
    (tmp_path / "file").write_text("")
    done = _run("plan", "--model", "llama3-tiny", "--parallel", "dp=2", "-o", str(tmp_path / "file" / "plan.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"tv-ray plan: cannot write {tmp_path / 'file' / 'plan.json'}: ")
    done = _run("plan", "--model", "llama3-tiny", "--parallel", "dp=2", "-o", str(tmp_path / "new" / "dir" / "p.json"))
    assert done.returncode == 0 and (tmp_path / "new" / "dir" / "p.json").exists()


def test_a_plan_is_validated_while_it_is_written_and_not_left_written_when_it_fails(tmp_path, capsys, monkeypatch):
    """`tv-ray plan` validates the plan in a forked process while it writes the file: a plan that fails validation
    ends with the validation's error, no file left; where that process dies without answering, the plan is
    validated here."""
    import json as json_
    from tv_ray import plan_check, processes
    from tv_ray.errors import PlanError
    from tv_ray.plan import Plan
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama3-tiny", "--parallel", "dp=2", "-o", str(out)]
    assert main(argv) == 0 and Plan.load(out).num_ranks == 2
    told = json_.loads(capsys.readouterr().out)
    assert told["ranks"] == 2 and told["plan"] == str(out)
    out.unlink()

    def broken(plan, dims=None):
        raise PlanError("programs.main.ops[3]: broken on purpose", path="programs.main.ops[3]")
    monkeypatch.setattr(plan_check, "check_plan", broken)
    assert main(argv) == 2 and not out.exists()
    assert capsys.readouterr().err == "tv-ray plan: programs.main.ops[3]: broken on purpose\n"
    monkeypatch.setattr(processes, "_answer", lambda fn, args, sender: os._exit(3))    # dies without answering
    assert main(argv) == 2 and not out.exists()        # validated here: the same error
    assert capsys.readouterr().err == "tv-ray plan: programs.main.ops[3]: broken on purpose\n"
    monkeypatch.undo()
    monkeypatch.setattr(processes, "_answer", lambda fn, args, sender: os._exit(3))
    assert main(argv) == 0 and Plan.load(out).num_ranks == 2


def test_explain_into_a_closed_pipe_ends_quietly(tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"status": "refuted", "headline": "h", "counts": {}, "problems": ' +
                      str([f"problem {i}" for i in range(5)]).replace("'", '"') + "}")
    done = subprocess.run(f"'{BIN / 'tv-ray'}' explain '{tmp_path}' | head -1", shell=True, capture_output=True,
                          text=True, env=ENV, timeout=60)
    assert done.stdout == "tv-ray: REFUTED — h\n"
    assert done.stderr == ""


def test_ctrl_c_ends_with_130_and_the_resume_command_not_a_traceback(tmp_path):
    out = tmp_path / "out"
    run = subprocess.Popen([str(BIN / "tv-ray"), "verify", "--model", "llama3-tiny", "--parallel",
                            "dp=2,tp=2,pp=2,mb=4", "-o", str(out), "--engine", "local"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint" / "run.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    # at once: the run has started its checkpoint and derives its stages (a second later it had ended once)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "Traceback" not in err
    assert err.endswith(f"tv-ray verify: interrupted\ntv-ray verify: the verdicts so far are in {out}/checkpoint; "
                        f"continue with `tv-ray verify --resume {out}`\n")


STUCK = """
import ctypes, subprocess, sys
from tv_ray.commands import Interrupts
child = subprocess.Popen(["sleep", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
with Interrupts("verify", lambda: print("resume hint", file=sys.stderr), grace_s=1.0):
    mutex = ctypes.create_string_buffer(64)     # a pthread mutex, statically initialised: all zero bytes
    libc = ctypes.CDLL(None)
    libc.pthread_mutex_lock(mutex)
    print("locked", flush=True)
    libc.pthread_mutex_lock(mutex)              # waits forever in native code: Python's handler never runs
"""


def test_a_ctrl_c_the_main_thread_never_sees_still_ends_the_command(tmp_path):
    """Ray's driver start can sit in native code that never returns to Python (a GCS connect a Ctrl-C caught half
    started), so Python's handler never runs: the watcher ends the command — the message, the resume hint, the
    processes below it (Ray's) killed, exit 130."""
    run = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV)
    child = int(run.stdout.readline())
    assert run.stdout.readline().strip() == "locked"
    deadline = time.monotonic() + 20       # the main thread in the second lock (a SIGINT before it reaches Python)
    while "futex" not in _read(f"/proc/{run.pid}/task/{run.pid}/wchan") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert err.splitlines() == ["tv-ray verify: interrupted", "resume hint"]
    deadline = time.monotonic() + 20
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)


FORKED = """
import os, signal, sys, time
from tv_ray.commands import Interrupts
with Interrupts("verify", grace_s=1.0):
    child = os.fork()
    if child == 0:                      # a forked worker interrupted alone (its own Ctrl-C)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            os._exit(7)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    time.sleep(3)                       # the watcher would have ended this process by now
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_worker_s_own_ctrl_c_does_not_end_the_command():
    """A process forked inside the block (stage generation's workers) drops the wakeup socket: its Ctrl-C is its
    own, and must not wake the watcher of the command, which never got one."""
    run = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True, timeout=60, env=ENV)
    assert (run.returncode, run.stdout.strip()) == (0, "7"), run.stderr


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "gone"


def test_a_ctrl_c_python_drops_in_a_weakref_callback_is_raised_again(monkeypatch):
    """Python drops an exception raised inside a weakref callback: a Ctrl-C landing there is remembered by
    `Interrupts` and raised at its `check` (the verify command checks before it saves), and not printed as
    "Exception ignored" with a traceback."""
    import weakref
    from tv_ray.commands import Interrupts
    printed = []
    monkeypatch.setattr(sys, "unraisablehook", printed.append)

    class Value:
        pass

    def callback(_ref):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100_000):      # the handler runs here, inside the callback: its exception is dropped
            pass

    dropped = True
    with Interrupts() as interrupts:
        value = Value()
        ref = weakref.ref(value, callback)
        try:
            del value
            for _ in range(100_000):
                pass
        except KeyboardInterrupt:     # (had it reached this frame instead, nothing would have been lost)
            dropped = False
        assert dropped and ref() is None and interrupts.seen and printed == []
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    assert signal.getsignal(signal.SIGINT) != interrupts._interrupted        # the previous handler is back
    assert sys.unraisablehook == printed.append


def _argvs_below(pid: int) -> list[list[str]]:
    """The command lines of every process below `pid`."""
    out = []
    for child in _descendants(pid):
        try:
            out.append(Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            pass
    return out


def _session_processes(session: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and session.encode() in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except OSError:
            pass
    return out


def test_a_ray_shutdown_that_hangs_is_abandoned_and_its_processes_killed():
    # in a process of its own: the stop kills every process below the one that calls it
    script = """
import subprocess, sys, time, types
sys.modules["ray"] = types.SimpleNamespace(shutdown=lambda: time.sleep(600))   # a GCS that never answers
from tv_ray.commands import _stop_ray
child = subprocess.Popen(["sleep", "600"])
started = time.monotonic()
stopped = _stop_ray(wait_s=1.0)
print(stopped, round(time.monotonic() - started), child.wait(timeout=10))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.stdout.split() == ["False", "1", str(-signal.SIGKILL)], done.stderr


def test_ctrl_c_while_ray_starts_leaves_no_ray_process_behind(tmp_path):
    run = subprocess.Popen([str(BIN / "tv-ray"), "verify", "--model", "llama3-tiny", "--parallel", "dp=2", "-o",
                            str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    session, deadline = None, time.monotonic() + 120
    while session is None and time.monotonic() < deadline:       # the local Ray's raylet is up: Ray is starting
        for argv in _argvs_below(run.pid):
            session = next((a.split("=", 1)[1] for a in argv if a.startswith("--session_dir=")), None)
            if session:
                break
        time.sleep(0.1)
    assert session, "no local Ray started"
    run.send_signal(signal.SIGINT)
    # Ray's shutdown of a half-started local Ray took over 60 s once, in a full suite on a loaded machine
    _, err = run.communicate(timeout=180)
    assert run.returncode == 130 and "Traceback" not in err, err
    deadline = time.monotonic() + 20
    while _session_processes(session) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(session) == []
