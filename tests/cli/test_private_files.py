"""Files the CLI and the manager trust are this user's alone (issue 58, item 2).

On a shared machine another user can make a folder before us, plant a state file naming
their own process, or put a link where we are about to write. Here the "other user" is a
uid with no account (files are given to it with chown, which needs root: those tests skip
with a reason elsewhere). The CLI runs as a real subprocess; nothing here starts a manager
(each refusal comes before one would be started).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jupyter_llama.private import UntrustedFile, open_log, read_trusted, trusted_folder, write_private

OTHER = 4242  # a uid that is not this process's
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user (chown) needs root")


def cli(env, *args):
    return subprocess.run([sys.executable, "-m", "jupyter_llama.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def env(tmp_path):
    """An environment whose background manager would live in ``tmp_path/manager``."""
    e = {k: v for k, v in os.environ.items() if k not in ("JUPYTER_LLAMA_URL", "JUPYTER_LLAMA_TOKEN",
                                                          "JPY_PARENT_PID")}
    e.update(JUPYTER_LLAMA_MODELS=str(tmp_path / "models"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
             JUPYTER_LLAMA_MANAGER_DIR=str(tmp_path / "manager"))
    return e


def test_a_folder_others_can_write_and_the_files_in_it_are_not_trusted(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UntrustedFile, match=r"can be written by other users \(mode 777\)"):
        trusted_folder(shared)
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    assert trusted_folder(readable) == readable  # nobody else can write to it
    with pytest.raises(UntrustedFile, match="can be read by other users .* a secret"):
        trusted_folder(readable, secret=True)
    made = trusted_folder(tmp_path / "new" / "folder", secret=True)
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(UntrustedFile, match="is a link, not a folder of yours"):
        trusted_folder(link)

    f = made / "state.json"
    assert read_trusted(f) is None  # none there
    write_private(f, '{"a": 1}')
    assert f.stat().st_mode & 0o777 == 0o600 and read_trusted(f, secret=True) == '{"a": 1}'
    f.chmod(0o666)
    with pytest.raises(UntrustedFile, match="can be written by other users"):
        read_trusted(f)
    f.chmod(0o644)
    with pytest.raises(UntrustedFile, match="can be read by other users"):
        read_trusted(f, secret=True)


def test_a_link_planted_where_a_file_is_written_is_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("theirs\n")
    folder = trusted_folder(tmp_path / "mine")
    state, log = folder / "state.json", folder / "manager.log"
    state.symlink_to(victim)
    log.symlink_to(victim)
    with pytest.raises(UntrustedFile, match="is a link, not a file of yours"):
        read_trusted(state)
    write_private(state, "ours")  # the link is replaced by a file of ours; its target is untouched
    assert not state.is_symlink() and state.read_text() == "ours"
    with pytest.raises(UntrustedFile, match="the log .* is a link"):
        open_log(log)
    assert victim.read_text() == "theirs\n"
    log.unlink()
    with open_log(log) as f:
        f.write(b"a line\n")
    assert log.stat().st_mode & 0o777 == 0o600 and log.read_bytes() == b"a line\n"


@as_root
def test_files_of_another_user_are_not_read(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(UntrustedFile, match=f"belongs to uid {OTHER}, not to you"):
        trusted_folder(theirs)
    planted = trusted_folder(tmp_path / "mine") / "jupyter-llama-usage-1.json"
    planted.write_text("{}")
    planted.chmod(0o600)
    os.chown(planted, OTHER, OTHER)
    with pytest.raises(UntrustedFile, match=f"belongs to uid {OTHER}"):
        read_trusted(planted)


@as_root
def test_a_manager_folder_another_user_made_first_is_refused_by_the_cli(env, tmp_path):
    """The campaign's case: another user made the manager folder first (open to all) and put
    a state file in it naming their process; every command refuses it, naming the folder and
    why, and sends nothing there."""
    folder = tmp_path / "manager"
    folder.mkdir()
    folder.chmod(0o777)
    state = {"url": "http://127.0.0.1:9/llama/", "token": "theirs", "pid": os.getpid(), "started": 0}
    (folder / "jupyter-llama-manager.json").write_text(json.dumps(state))
    os.chown(folder / "jupyter-llama-manager.json", OTHER, OTHER)
    os.chown(folder, OTHER, OTHER)
    for args in (("status",), ("ps",), ("run", "tiny", "a secret prompt")):
        r = cli(env, *args)
        assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
        assert f"{folder} belongs to uid {OTHER}, not to you" in r.stderr, r.stderr
        assert "JUPYTER_LLAMA_MANAGER_DIR" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_link_planted_as_the_managers_log_stops_the_start_and_is_not_followed(env, tmp_path):
    folder = trusted_folder(tmp_path / "manager", secret=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("theirs\n")
    (folder / "jupyter-llama-manager.log").symlink_to(victim)
    r = cli(env, "ps")
    assert r.returncode != 0 and "jupyter-llama-manager.log is a link" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert victim.read_text() == "theirs\n"
    assert not (folder / "jupyter-llama-manager.json").exists()  # no manager was started
