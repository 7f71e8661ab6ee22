"""What the commands print, for people and for scripts: usage lines naming bin/..., fixes never cut
at the terminal's width, strict --json on every command."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "bin"


def run(*argv, env=None, cwd=None):
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.mark.parametrize("command", ["preflight", "smoke", "envsetup"])
def test_help_names_the_command_the_user_typed(command):
    out = run(command, "--help", env={"PODKIT_PYTHON": str(ROOT / ".venv" / "bin" / "python")})
    assert out.returncode == 0
    assert f"bin/{command}" in out.stdout.splitlines()[0], out.stdout[:200]
    assert "-m " not in out.stdout.splitlines()[0]


def test_fix_text_is_not_cut_at_80_columns():
    out = run("preflight", env={"COLUMNS": "80", "PYTORCH_CUDA_ALLOC_CONF": ""})
    assert "…" not in out.stdout
    joined = "".join(line.strip("│ ") for line in out.stdout.splitlines())
    assert "expandable_segments:True" in joined.replace("│", "").replace(" ", "")


def test_envsetup_json_dry_run_is_one_strict_object(tmp_path):
    fp = tmp_path / "fp.json"
    fp.write_text('{"python": "/usr/bin/python3", "python_version": "3.11.7", "gpus": []}')
    out = run("envsetup", "--fingerprint", str(fp), "--dry-run", "--json",
              env={"PODKIT_PYTHON": str(ROOT / ".venv" / "bin" / "python")})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert data["ok"] is True and data["dry_run"] is True
    assert {d["name"] for d in data["plan"]} >= {"bitsandbytes", "flash-attn"}
    assert data["attention"] == "sdpa"


def test_preflight_json_is_strict():
    out = run("preflight", "--json", "--no-probe")
    json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"bare {c}"))


@pytest.mark.parametrize("command, typed, expected", [("preflight", "--js", "--json"), ("smoke", "--si", "--sink"),
                                                     ("plot", "--ou", "--output")])
def test_bash_completion_completes_options(command, typed, expected):
    """The README's completion recipe: the script click emits completes this command's options."""
    var = f"_PODKIT_{command.upper()}_COMPLETE"
    script = (f'eval "$({var}=bash_source bin/{command})"; COMP_WORDS=(bin/{command} {typed}); COMP_CWORD=1; '
              f'_bin{command}_completion bin/{command}; echo "${{COMPREPLY[@]}}"')
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [expected], out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/unshare").exists(),
                    reason="a read-only mount is made with a private mount namespace: needs root and unshare")
def test_envsetup_refuses_a_read_only_project(tmp_path):
    project = tmp_path / "ro"
    project.mkdir()
    script = (f"mount --bind {project} {project} && mount -o remount,ro,bind {project} || exit 99; "
              f"PODKIT_PYTHON={ROOT / '.venv' / 'bin' / 'python'} {BIN / 'envsetup'} --project {project}")
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                         text=True, timeout=120)
    if out.returncode == 99:
        pytest.skip("this container may not bind-mount")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [out.stderr.strip()] and "not writable" in out.stderr
    assert not (project / ".venv").exists()


CONNECTING = ["deploy", "fetch-logs", "run", "attach", "stop", "jobs", "probe"]
TRANSFERRING = {"deploy", "fetch-logs"}


@pytest.mark.parametrize("command", CONNECTING)
def test_pod_options_only_where_they_belong(command):
    """Connection options on every command that reaches a pod; --bwlimit only where files move."""
    out = run("pod", command, "--help")
    assert out.returncode == 0, out.stderr
    assert "--known-hosts" in out.stdout and "--timeout" in out.stdout
    assert ("--bwlimit" in out.stdout) == (command in TRANSFERRING), out.stdout


@pytest.mark.parametrize("command", CONNECTING)
def test_bwlimit_is_parsed_by_transfer_commands_and_refused_elsewhere(command):
    import click

    from podkit.pods.cli import main

    cmd = main.commands[command]
    argv = ["--bwlimit", "1500", "some-pod"] + (["true"] if command == "run" else [])
    if command in TRANSFERRING:
        assert cmd.make_context(command, argv).params["bwlimit"] == 1500
    elif command == "run":  # run passes unknown options through to the pod's COMMAND; never a transfer limit
        assert "bwlimit" not in cmd.make_context(command, argv).params
    else:
        with pytest.raises(click.NoSuchOption):
            cmd.make_context(command, argv)


def test_attach_with_bwlimit_is_one_usage_line():
    out = run("pod", "attach", "--bwlimit", "10", "some-pod")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["error: No such option '--bwlimit'. (see bin/pod attach --help)"]


def strict(text: str):
    """json.loads that fails on NaN/Infinity (what other tools' parsers refuse)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_plot_json_lists_every_png_written(tmp_path):
    pytest.importorskip("matplotlib", reason="bin/plot draws with matplotlib ([plot] extra, installed by make setup)")
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"device": "cpu", "predicted": 2**20, "status": "pass"}))
    for name in ("metrics.jsonl", "metrics.rank1.jsonl"):
        (run_dir / name).write_text("".join(
            json.dumps(r) + "\n" for s in range(1, 4)
            for r in ({"step": s, "loss": 3.0 / s}, {"profile": {"step": s, "peak_allocated": s * 2**20}})))
    out = run("plot", str(run_dir), "--per-rank", "--json", "-o", str(tmp_path / "m.png"))
    assert out.returncode == 0, out.stderr
    data = strict(out.stdout)
    assert data["ok"] is True and data["curves"] == ["r rank 0", "r rank 1"]
    assert data["written"] == [str(tmp_path / "m.png"), str(tmp_path / "m.rank1.png")]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in data["written"])


@pytest.mark.parametrize("argv, command, run_opts", [
    (["pod", "bin/smoke", "--json", "-d"], ("bin/smoke", "--json", "-d"), {"as_json": False, "detach": False}),
    (["--json", "-d", "pod", "--", "bin/smoke", "--json"], ("bin/smoke", "--json"), {"as_json": True, "detach": True}),
    (["pod", "--json", "--id=j1", "python", "x.py", "--timeout", "5"], ("python", "x.py", "--timeout", "5"),
     {"as_json": True, "job_id": "j1", "timeout": 10.0}),
    (["pod", "python", "-c", "print(1)"], ("python", "-c", "print(1)"), {}),
    (["pod", "bin/smoke", "--json", "--", "python", "t.py"], ("bin/smoke", "--json", "--", "python", "t.py"),
     {"as_json": False}),
    (["-d", "pod", "--", "bin/smoke", "--", "python", "t.py"], ("bin/smoke", "--", "python", "t.py"), {"detach": True}),
])
def test_run_passes_every_word_from_the_command_on_to_the_pod(argv, command, run_opts):
    """`bin/pod run a100 bin/smoke --json` must not take bin/smoke's --json as run's own."""
    from podkit.pods.cli import main

    params = main.commands["run"].make_context("run", list(argv)).params
    assert params["host"] == "pod" and params["command"] == command
    assert {k: params[k] for k in run_opts} == run_opts


def _complete(command: str, shell: str, words: str, cword: int) -> list[str]:
    """What the shell's completion function gets back from the command: click's protocol through the
    README's variable (bash: 'type,value' lines; zsh: type, value, help, one per line)."""
    var = f"_PODKIT_{command.upper()}_COMPLETE"
    out = run(command, env={var: f"{shell}_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)})
    assert out.returncode == 0, out.stderr
    if shell == "bash":
        return [line.split(",", 1)[1] for line in out.stdout.splitlines() if line.startswith("plain,")]
    lines = out.stdout.splitlines()
    return [lines[i + 1] for i in range(0, len(lines) - 2, 3) if lines[i] == "plain"]


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("command, words, cword, expected", [
    ("preflight", "bin/preflight --tr", 1, ["--traced"]),
    ("smoke", "bin/smoke --dev", 1, ["--device"]),
    ("smoke", "bin/smoke --device ", 2, ["auto", "cuda", "cpu"]),
    ("pod", "bin/pod fe", 1, ["fetch-logs"]),
    ("pod", "bin/pod deploy --bw", 2, ["--bwlimit"]),
    ("pod", "bin/pod attach --bw", 2, []),  # no --bwlimit where nothing is transferred
])
def test_completion_variable_returns_candidates(shell, command, words, cword, expected):
    assert _complete(command, shell, words, cword) == expected


@pytest.mark.parametrize("command", ["preflight", "smoke", "pod"])
def test_completion_scripts_in_the_readme_register_for_the_command(command):
    """The README's lines: each shell's script binds its function to bin/<command>, as typed."""
    var = f"_PODKIT_{command.upper()}_COMPLETE"
    bash = run(command, env={var: "bash_source"})
    zsh = run(command, env={var: "zsh_source"})
    assert f"complete -o nosort -F _bin{command}_completion bin/{command}" in bash.stdout
    assert f"compdef _bin{command}_completion bin/{command}" in zsh.stdout
    readme = (ROOT / "README.md").read_text()
    for shell in ("bash", "zsh"):
        assert f'eval "$({var}={shell}_source bin/{command})"' in readme


def test_bin_pod_bash_completion_through_the_emitted_function():
    script = ('eval "$(_PODKIT_POD_COMPLETE=bash_source bin/pod)"; COMP_WORDS=(bin/pod jo); COMP_CWORD=1; '
              '_binpod_completion bin/pod; echo "${COMPREPLY[@]}"')
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["jobs"], out.stderr
